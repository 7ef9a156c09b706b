"""Device probe: how a row's anchor follows its max (kernel only, same process).

  shipped          the FFMAs at once on the row's anchor; after the PV wait the FP16 packing, with the packed halves'
                   max (max.u16x2, fused into 13 VIMNMX3 + 5 VIMNMX a thread) and one warp vote: a code above 126
                   (E4M3's 448) takes the warp to the rare path (``ExpCastSoftmax.move_anchor``), which lowers those
                   rows' anchors so that their top code is 120, rescales, shifts the FP32 codes and packs again
  row max first    the kernel until 2026-12-03: per key tile and row the raw scores' max (64 FMNMX a thread, two
                   shuffles), the anchor from it (``rne(119.65 - s m)``, m the running max), then the FFMAs; after the
                   PV wait the rescale where the anchor moved, the promotion, the packing

  moves to 112     the shipped kernel, a move putting the top code an octave lower (111 or 112): more headroom
  anchors at 112   the same, and the first anchor too (timing and accuracy only: not the reference's semantics)

The first two differ in their semantics (the README's, items 2-4): the shipped kernel's codes may reach 126 before an
anchor moves, the other's stay at 119 or 120 and move with every new max past half a code, so their outputs differ
at ExpCast's rounding (its error against float64 the same); this prints that difference and the time of three
rounds. Run on a Hopper GPU: ``python notes/probe_code_check.py``; ``--sass DIR`` dumps each variant's SASS (no GPU
needed). ``tests/test_probes.py`` compiles every variant on the CPU.
"""

import argparse
import os
import subprocess
import sys

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from openvc_kernels.expcast import LOG2_PER_CODE
from openvc_kernels.ops import compile_attention, forward_args
from openvc_kernels.sm90 import ptx, softmax
from openvc_kernels.sm90.config import ForwardConfig
from openvc_kernels.sm90.fwd import ExpCastAttentionSm90

SHAPES = ((32_760, 12), (75_600, 40))
TAU = 128**-0.5


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


class MovesLower(softmax.ExpCastSoftmax):
    """A move puts the top code on 111 or 112 (``target``, an octave under the shipped 119.65): 14 codes of headroom
    after a move instead of 6 (semantics not the reference's: timing and accuracy only)."""

    target = softmax.EXPCAST_BIAS - 8

    @cute.jit
    def move_anchor(self, acc_pv: cute.Tensor):
        scores, anchor, pending = self.scores, self.anchor, self.pending
        tile = softmax.rows_view(acc_pv)
        for r in cutlass.range_constexpr(2):
            top = softmax.row_max(scores, r) * Float32(softmax.UNITS_PER_CODE)
            if cute.math.roundeven(top) > Float32(softmax.TOP_CODE):
                shift = cute.math.roundeven(top - Float32(self.target))
                anchor[r] = anchor[r] - shift
                alpha = cute.math.exp2(-shift * LOG2_PER_CODE, fastmath=True)
                pending[r] = pending[r] * alpha
                for i in cutlass.range_constexpr(cute.size(tile, mode=[1])):
                    tile[r, i] = tile[r, i] * alpha
                step = shift * Float32(softmax.CODE_UNIT)
                for i in cutlass.range_constexpr(cute.size(scores, mode=[1])):
                    scores[r, i] = scores[r, i] - step


class AnchorsLower(MovesLower):
    """Also the first anchor an octave lower: every row's top code on 111 or 112 until a code passes 126."""

    @cute.jit
    def first_anchor(self, d_k: Float32):
        for r in cutlass.range_constexpr(2):
            m = ptx.mul_rn(softmax.row_max(self.scores, r), d_k)
            self.anchor[r] = cute.math.roundeven(Float32(self.target) - ptx.mul_rn(self.s, m))


VARIANTS = {
    "shipped": softmax.ExpCastSoftmax, "row max first": RowMaxFirst, "moves to 112": MovesLower,
    "anchors at 112": AnchorsLower,
}


def compile_variant(name: str):
    class Variant(ExpCastAttentionSm90):
        softmax_class = VARIANTS[name]

    return compile_attention(ForwardConfig(), Variant)


def dump_sass(folder: str) -> None:
    """One subprocess per variant: the DSL reads its dump settings at import."""
    for name in VARIANTS:
        dump = os.path.join(folder, name.replace(" ", "_"))
        os.makedirs(dump, exist_ok=True)
        env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="sass", CUTE_DSL_DUMP_DIR=dump)
        script = f"import probe_code_check as p; p.compile_variant({name!r})"
        subprocess.run([sys.executable, "-c", script], env=env, check=True, cwd=os.path.dirname(__file__))


def main():
    import torch
    from triton.testing import do_bench

    from openvc_kernels.ops import prepare

    print(torch.cuda.get_device_name(), flush=True)
    kernels = {name: compile_variant(name) for name in VARIANTS}
    for seq, heads in SHAPES:
        flop = 4 * seq * seq * heads * 128
        sets, inputs = [], []
        for _ in range(2):
            q, k, v = (torch.randn(1, seq, heads, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            out = torch.full_like(q, float("nan"))
            inputs.append((q, k, v))
            sets.append(forward_args(prepare(q, k, v), out, softmax_scale=TAU, window=4, split_tail=True))
        rows = torch.randperm(seq, device="cuda")[:256]
        exact = torch.nn.functional.scaled_dot_product_attention(
            *(t.double().transpose(1, 2) for t in (inputs[0][0][:, rows], *inputs[0][1:]))
        ).transpose(1, 2)
        outs = {}
        for name, kernel in kernels.items():
            sets[0].out.fill_(float("nan"))
            sets[0].arrivals.zero_()  # the split's counters start at 0 in every launch
            kernel(*sets[0])
            outs[name] = sets[0].out.float().clone()
        for name, o in outs.items():
            apart = ((o - outs["shipped"]).norm() / outs["shipped"].norm()).item()
            error = ((o[:, rows].double() - exact).norm() / exact.norm()).item()
            print(f"{seq}x{heads} {name:>13}: finite {bool(o.isfinite().all())}, rel-L2 vs shipped {apart:.2e}, "
                  f"vs float64 {error:.4%}", flush=True)
        for rnd in range(3):
            for name, kernel in (kernels.items() if rnd % 2 == 0 else reversed(kernels.items())):
                turn = iter(range(10**9))
                call = lambda kernel=kernel, sets=sets, turn=turn: kernel(*sets[next(turn) % 2])  # noqa: E731
                ms = do_bench(call, warmup=100, rep=600, return_mode="median")
                print(f"{seq}x{heads} round {rnd} {name:>13}: {ms:8.2f} ms {flop / ms / 1e9:7.0f} TFLOP/s",
                      flush=True)
        del sets, outs, inputs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sass", metavar="DIR", help="compile every variant for sm_90a and dump SASS into DIR")
    args = parser.parse_args()
    dump_sass(args.sass) if args.sass else main()
