"""Device probe: where the kernel's repair tiles spend their time (kernel only, settings interleaved call by call).

  no repair                the shipped kernel on inputs prepared without repair keys
  shipped                  the shipped kernel with the processor's rho (its repair tiles last)
  last tile whole          the shipped kernel on the same keys and 64 zero keys more, where its last repair tile
                           holds 64 keys (``preparation.with_whole_repair_tiles``): the half tile's saving
  loaded at the tile       each thread loads its 32 columns' descales at the tile, after the wgmmas (the kernel
                           before ``softmax.REPAIR_KEYS_PER_LANE``'s shuffles): whole units only, timing only
  descales not loaded      repair tiles encoded with one coefficient for every key (s, d_k = 1) instead of each
                           key's own d_k from global memory: wrong codes, timing only
  encoded as a real tile   repair tiles through the real tiles' encode (one d_k for every key): wrong codes, timing
                           only

Prints each setting's median ms and its time over "no repair" (the median over rounds of the ratio within a round).
"""

import os
import statistics
import sys

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from bench_attention import median_over, time_interleaved  # noqa: E402

from openvc_diffusers.config import OpenVCConfig  # noqa: E402
from openvc_kernels.expcast import CODE_UNIT, TOP_CODE  # noqa: E402
from openvc_kernels.ops import forward_args, prepare  # noqa: E402
from openvc_kernels.preparation import with_whole_repair_tiles  # noqa: E402
from openvc_kernels.sm90.ptx import mul_rn  # noqa: E402
from openvc_kernels.sm90 import softmax  # noqa: E402
import variant_runner  # noqa: E402

SHAPES = ((32760, 12), (73397, 7))
BUDGET_MS = 8000
TAU = 128**-0.5


class LoadedAtTheTile(softmax.ExpCastSoftmax):
    """Each thread loads its 32 columns' descales at the tile, after its wgmmas (the kernel of 2026-12-01)."""

    @cute.jit
    def load_repair_keys(self, d_k: cute.Tensor, first: Int32, half: cutlass.Constexpr[bool]):
        self.at_the_tile = (d_k, first)  # read while the same step is traced

    @cute.jit
    def encode_repair_keys(self, token_tiles, visits: cutlass.Constexpr, half: cutlass.Constexpr[bool]):
        d_k, first = self.at_the_tile
        scores, anchor, s = self.tile_scores(half), self.anchor, self.s
        unit = Float32(CODE_UNIT)
        top = Float32(TOP_CODE * CODE_UNIT)
        for i in cutlass.range_constexpr(cute.size(scores, mode=[1])):
            coef = mul_rn(s, d_k[first + self.key_coords[0, i][1]]) * unit
            for r in cutlass.range_constexpr(2):
                scores[r, i] = cute.arch.fmin(cute.math.fma(scores[r, i], coef, anchor[r] * unit), top)


class UnloadedDescales(softmax.ExpCastSoftmax):
    @cute.jit
    def load_repair_keys(self, d_k: cute.Tensor, first: Int32, half: cutlass.Constexpr[bool]):
        pass

    @cute.jit
    def encode_repair_keys(self, token_tiles, visits: cutlass.Constexpr, half: cutlass.Constexpr[bool]):
        scores, anchor = self.tile_scores(half), self.anchor
        unit = Float32(CODE_UNIT)
        top = Float32(TOP_CODE * CODE_UNIT)
        coef = self.s * unit
        for r in cutlass.range_constexpr(2):
            bias = anchor[r] * unit
            for i in cutlass.range_constexpr(cute.size(scores, mode=[1])):
                scores[r, i] = cute.arch.fmin(cute.math.fma(scores[r, i], coef, bias), top)


class RealTileEncode(softmax.ExpCastSoftmax):
    @cute.jit
    def encode_repair(
        self, tiles: cute.Tensor, first: Int32, visits, whole: cutlass.Boolean, half: cutlass.Constexpr[bool]
    ):
        self.online_codes(False, Int32(0), self.repair_d_k[0], False)


VARIANTS = {
    "shipped": softmax.ExpCastSoftmax,
    "loaded at the tile": LoadedAtTheTile,
    "descales not loaded": UnloadedDescales,
    "encoded as a real tile": RealTileEncode,
}


def compile_variant(name: str):
    return variant_runner.compile_with_softmax(VARIANTS[name])


def main():
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), flush=True)
    kernels = {name: compile_variant(name) for name in VARIANTS}
    rho = OpenVCConfig().repair_ratio
    for seq, heads in SHAPES:
        sets = [[torch.randn(1, seq, heads, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
                for _ in range(2)]
        out = torch.empty_like(sets[0][0])
        args = {
            ratio: [forward_args(prepare(*s, repair_ratio=ratio), out, softmax_scale=TAU, window=4, split_tail=True)
                    for s in sets]
            for ratio in (0.0, rho)
        }
        calls = {"no repair": lambda i: variant_runner.launch(kernels["shipped"], args[0.0][i])}
        for name, kernel in kernels.items():
            calls[name] = lambda i, kernel=kernel: variant_runner.launch(kernel, args[rho][i])
        if args[rho][0].d_k_repair.shape[-1] % 128:
            whole = [forward_args(with_whole_repair_tiles(prepare(*s, repair_ratio=rho)), out, softmax_scale=TAU,
                                  window=4, split_tail=True) for s in sets]
            calls["last tile whole"] = lambda i: variant_runner.launch(kernels["shipped"], whole[i])
        times = time_interleaved(list(calls.values()), [[0], [1]], "back_to_back", BUDGET_MS)
        tiles = args[rho][0].repair_tiles
        print(f"S={seq} H={heads}: {tiles} repair tiles of {args[0.0][0].k8.shape[2] // 128} key tiles")
        for name, own in zip(calls, times):
            over = median_over(own, times[0])
            print(f"  {name:24s} {statistics.median(own):9.3f} ms  {100 * over:+6.2f}%", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
