"""Device probe: how a row's anchor follows its max (kernel only, same process).

  shipped          the FFMAs at once on the row's anchor; after the PV wait the FP16 packing, with each row's packed
                   halves' max (max.u16x2, fused into VIMNMX3) and one warp vote: a code above 126 (E4M3's 448) takes
                   the warp to the rare path (``ExpCastSoftmax.move_anchor``), which lowers those rows' anchors by
                   their packed top code less 112 (``expcast.MOVE_CODE``, an octave under a first anchor's top),
                   rescales, shifts the FP32 codes and packs again
  fp32 row max     the shipped kernel of 2026-12-04 04:12: the rare path finds each row's top code as the max of its
                   FP32 codes (32 FMNMX a row, two shuffles) instead of reading it off the packed maxima
  row max first    the kernel until 2026-12-03: per key tile and row the raw scores' max (64 FMNMX a thread, two
                   shuffles), the anchor from it (``code_anchor``, m the running max), then the FFMAs; after the
                   PV wait the rescale where the anchor moved, the promotion, the packing
  moves to 120     a move puts the top code on 120 (6 codes of headroom before the next move, not 14; the kernel of
                   2026-12-04 00:26 put it on 119 or 120)

"shipped" and "row max first" differ in their semantics (the README's, items 2-4): the shipped kernel's codes may
reach 126 before an anchor moves, the other's stay at 103 or 104 and move with every new max past half a code, so
their outputs differ at ExpCast's rounding (its error against float64 the same); this prints that difference, the
error and the time of three rounds (``variant_runner``). Run on a Hopper GPU: ``python notes/probe_code_check.py``; ``--sass DIR`` dumps
each variant's SASS (no GPU needed). ``tests/test_probes.py`` compiles every variant on the CPU.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

import variant_runner
from openvc_kernels.expcast import LOG2_PER_CODE
from openvc_kernels.sm90 import ptx, softmax


class RowMaxFirst(softmax.ExpCastSoftmax):
    """The running max ``m`` before the FFMAs; ``alpha`` rescales the sums after the PV wait; no check."""

    def __init__(self, *args):
        super().__init__(*args)
        self.m = cute.make_rmem_tensor((2,), Float32)
        self.alpha = cute.make_rmem_tensor((2,), Float32)

    @cute.jit
    def online_codes(self, has_padding, valid_keys, d_k: Float32, is_first: cutlass.Constexpr[bool]):
        if has_padding:
            self.mask_keys(valid_keys)
        scores, m, anchor, alpha, s = self.scores, self.m, self.anchor, self.alpha, self.s
        for r in cutlass.range_constexpr(2):
            tile_max = ptx.mul_rn(softmax.row_max(scores, r), d_k)
            if const_expr(is_first):
                m[r] = tile_max
                anchor[r] = softmax.code_anchor(tile_max, s)
            else:
                m[r] = cute.arch.fmax(m[r], tile_max)
                new_anchor = softmax.code_anchor(m[r], s)
                alpha[r] = Float32(1.0)
                if new_anchor != anchor[r]:
                    alpha[r] = cute.math.exp2((new_anchor - anchor[r]) * LOG2_PER_CODE, fastmath=True)
                anchor[r] = new_anchor
        self.encode(ptx.mul_rn(s, d_k))

    @cute.jit
    def encode_repair(self, tiles, first, visits, whole, half: cutlass.Constexpr[bool]):
        self.alpha.fill(1.0)
        super().encode_repair(tiles, first, visits, whole, half)

    @cute.jit
    def promote(self, acc_o: cute.Tensor, acc_pv: cute.Tensor, due: cutlass.Boolean):
        alpha, pending, tile = self.alpha, self.pending, softmax.rows_view(acc_pv)
        for r in cutlass.range_constexpr(2):
            if alpha[r] != Float32(1.0):
                pending[r] = pending[r] * alpha[r]
                for i in cutlass.range_constexpr(cute.size(tile, mode=[1])):
                    tile[r, i] = tile[r, i] * alpha[r]
            alpha[r] = Float32(1.0)  # the last tile's promotion comes after no new tile
        super().promote(acc_o, acc_pv, due)

    @cute.jit
    def pack_codes_checked(self, frag_p: cute.Tensor, acc_pv: cute.Tensor):
        self.pack_codes(frag_p, False)


class MovesTo120(softmax.ExpCastSoftmax):
    """A move puts the top code where a first anchor does (120)."""

    move_code = 120


class Fp32RowMax(softmax.ExpCastSoftmax):
    """The move's top code from the FP32 codes (each row's max, rounded), as the kernel took it until 2026-12-04."""

    @cute.jit
    def move_anchor(self, acc_pv: cute.Tensor, tops):
        scores, anchor, pending = self.scores, self.anchor, self.pending
        tile = softmax.rows_view(acc_pv)
        for r in cutlass.range_constexpr(2):
            top = cute.math.roundeven(softmax.row_max(scores, r) * Float32(softmax.UNITS_PER_CODE))
            if top > Float32(softmax.TOP_CODE):
                shift = top - Float32(self.move_code)
                anchor[r] = anchor[r] - shift
                alpha = cute.math.exp2(-shift * LOG2_PER_CODE, fastmath=True)
                pending[r] = pending[r] * alpha
                for i in cutlass.range_constexpr(cute.size(tile, mode=[1])):
                    tile[r, i] = tile[r, i] * alpha
                step = shift * Float32(softmax.CODE_UNIT)
                for i in cutlass.range_constexpr(cute.size(scores, mode=[1])):
                    scores[r, i] = scores[r, i] - step


VARIANTS = {
    "shipped": softmax.ExpCastSoftmax, "fp32 row max": Fp32RowMax, "row max first": RowMaxFirst,
    "moves to 120": MovesTo120,
}


def compile_variant(name: str):
    return variant_runner.compile_with_softmax(VARIANTS[name])


if __name__ == "__main__":
    variant_runner.main(__doc__, "probe_code_check")
