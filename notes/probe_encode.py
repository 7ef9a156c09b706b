"""Device probe: how ExpCast's codes are packed, ping-pong, and where d_k comes from (kernel only, same process).

  shipped                  FFMA -> code * 2^-24; cvt.rn.relu.f16x2.f32 rounds, clips and packs two codes; one
                           PRMT per four (per warp and key tile: 64 FFMA + 32 F2FP + 16 PRMT); ping-pong on
  clip + 3 PRMT            session 3's packing: FFMA with the 2^23 magic, FMNMX clip, 3 PRMT per four codes
                           (64 FFMA + 64 FMNMX + 48 PRMT), with and without ping-pong
  no ping-pong             the shipped packing, consumer warpgroups not taking turns
  convert before PV wait   the FP16 conversions inside encode (before PV(i - 1) retires), only PRMTs after it

The two packings of earlier kernels do not check the codes (``Unchecked``): a row's anchor stays where its first key
tile put it, so rows whose max rises later overflow their codes (wrong outputs; the time is what this compares).
Prints each variant's output difference from the shipped kernel, its error against float64 and the time of three
rounds (``variant_runner``). Run on a Hopper GPU: ``python notes/probe_encode.py``; ``--sass DIR`` compiles every
variant for sm_90a and dumps its SASS (no GPU needed). ``tests/test_probes.py`` compiles every variant on the CPU.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Uint32
from cutlass.cutlass_dsl import T, dsl_user_op

import variant_runner
from openvc_kernels.expcast import CODE_UNIT
from openvc_kernels.sm90 import ptx, softmax
from openvc_kernels.sm90.config import ForwardConfig

ROUND_MAGIC = float(2**23)
"""Session 3's encode: added to a code in [0, 2^23), the FP32 rounding is the RNE to an integer in the low bits."""
LOW_BYTES, HALVES = 0x0040, 0x5410
"""Session 3's prmt selectors: low bytes of two words side by side; two such halves into one word."""



def fill_pv_operand(frag_p: cute.Tensor, words: cute.Tensor, word_at):
    """Word ``r + 2 h + 4 kb`` of the PV A fragment is ``word_at(words, r, c)``, c = 4 kb + 2 h (as in
    ``ExpCastSoftmax.pack_codes``); a plain function, unrolled where a jit function calls it."""
    p_words = cute.recast_tensor(frag_p, Uint32)
    for kb in range(cute.size(frag_p, mode=[2])):
        for h in range(2):
            for r in range(2):
                p_words[r + 2 * h + 4 * kb] = word_at(words, r, 4 * kb + 2 * h)


def magic_word(words: cute.Tensor, r: int, c: int):
    first = ptx.byte_perm(words[2 * r + 4 * c], words[1 + 2 * r + 4 * c], LOW_BYTES)
    second = ptx.byte_perm(words[2 * r + 4 * (c + 1)], words[1 + 2 * r + 4 * (c + 1)], LOW_BYTES)
    return ptx.byte_perm(first, second, HALVES)


class Unchecked(softmax.ExpCastSoftmax):
    """A packing of its own, without the shipped one's check of the codes (the anchors never move)."""

    @cute.jit
    def pack_codes_checked(self, frag_p: cute.Tensor, acc_pv: cute.Tensor):
        self.pack_codes(frag_p, False)


class ClipAndPermute(Unchecked):
    """Session 3's codes: the 2^23-magic FFMA, an FMNMX clip, three PRMTs per four codes."""

    @cute.jit
    def encode(self, coef: Float32):
        scores, anchor = self.scores, self.anchor
        magic = Float32(ROUND_MAGIC)
        for r in cutlass.range_constexpr(2):
            bias = anchor[r] + magic
            for i in cutlass.range_constexpr(cute.size(scores, mode=[1])):
                scores[r, i] = cute.arch.fmax(cute.math.fma(scores[r, i], coef, bias), magic)

    @cute.jit
    def pack_codes(self, frag_p: cute.Tensor, half: cutlass.Constexpr[bool]):
        # Every k-block, also for a half tile: its PV reads the first two.
        fill_pv_operand(frag_p, cute.recast_tensor(self.acc_s, Uint32), magic_word)


@dsl_user_op
def pack_f16_relu_in_f32(high: Float32, low: Float32, *, loc=None, ip=None) -> Float32:
    """``ptx.pack_codes_f16`` whose word stays in an FP32 register (the score's), for packing later."""
    operands = [Float32(high).ir_value(loc=loc, ip=ip), Float32(low).ir_value(loc=loc, ip=ip)]
    instruction = "{ .reg .b32 w; cvt.rn.relu.f16x2.f32 w, $1, $2; mov.b32 $0, w; }"
    return Float32(ptx.ptx(T.f32(), operands, instruction, "=f,f,f"))


def converted_word(words: cute.Tensor, r: int, c: int):
    return ptx.byte_perm(words[2 * r + 4 * c], words[2 * r + 4 * (c + 1)], softmax.HALF_LOW_BYTES)


class ConvertEarly(Unchecked):
    """The FFMAs and the FP16 conversions before the PV wait (a pair's word replaces its first score, column 2c),
    only the PRMTs after it."""

    @cute.jit
    def encode(self, coef: Float32):
        scores, anchor = self.scores, self.anchor
        unit = Float32(CODE_UNIT)
        coef = coef * unit
        for r in cutlass.range_constexpr(2):
            bias = anchor[r] * unit
            for c in cutlass.range_constexpr(cute.size(scores, mode=[1]) // 2):
                low = cute.math.fma(scores[r, 2 * c], coef, bias)
                high = cute.math.fma(scores[r, 2 * c + 1], coef, bias)
                scores[r, 2 * c] = pack_f16_relu_in_f32(high, low)

    @cute.jit
    def pack_codes(self, frag_p: cute.Tensor, half: cutlass.Constexpr[bool]):
        fill_pv_operand(frag_p, cute.recast_tensor(self.acc_s, Uint32), converted_word)


NO_PP = ForwardConfig(pingpong=False)
VARIANTS = {
    "shipped": (softmax.ExpCastSoftmax, ForwardConfig()),
    "clip + 3 PRMT": (ClipAndPermute, NO_PP),
    "clip + 3 PRMT, ping-pong": (ClipAndPermute, ForwardConfig()),
    "no ping-pong": (softmax.ExpCastSoftmax, NO_PP),
    "convert before PV wait": (ConvertEarly, ForwardConfig()),
}


def compile_variant(name: str):
    return variant_runner.compile_with_softmax(*VARIANTS[name])


if __name__ == "__main__":
    variant_runner.main(__doc__, "probe_encode")
