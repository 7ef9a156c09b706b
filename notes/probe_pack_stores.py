"""Device probe: packed V's stores as whole rows (shipped) against the way before 2026-12-04, in one process.

Before, thread t of PackV stored 16 positions of channel t % 128 (a warp: 16 bytes into each of 32 packed rows, half
a 32-byte sector per lane) from an unswizzled ``sV8``; now eight neighbouring threads store one row's 128 bytes and
``sV8``'s 16-byte chunks are swizzled so that the byte reads stay one wavefront (``prep.SV8_SWIZZLE``).
``HalfSectorPackV`` below is the kernel before.

Both ways must write the same bytes (checked first, packed V, d_v and the energies). Then V's absmax (with K's block
sums for the defaults) and packed V (with the energies for the defaults), the pair that runs in a call, are timed
interleaved call by call each way (``probe_prep_order.compare_pack_ways``): the median us and the shipped way's time
over the other's (the median over rounds of the ratio within a round).
Run on a GPU from the repository root: ``python notes/probe_pack_stores.py``.
"""

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Uint8

from openvc_kernels import prep_ops
from openvc_kernels.quant import BLOCK
from openvc_kernels.sm90 import prep
from openvc_kernels.sm90.layout import E4M3_ONE, HEAD_DIM, KEY_PERMUTATION, ONES_ROWS
from probe_prep_order import DTYPE, compare_pack_ways

SHAPES = ((32760, 12), (75600, 40))
VARIANTS = ("pack_v", "pack_v_energy")
"""The kinds compiled with ``HalfSectorPackV`` (``compile_variant``)."""


def _channel_major_copy(dtype, channels: int, groups: int) -> cute.TiledCopy:
    """Thread t takes channel t % channels, position group t // channels: thr (channels, groups):(1, channels)."""
    thr = cute.make_layout((channels, groups), stride=(1, channels))
    val = cute.make_layout((1, prep.KEYS_PER_STORE))
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=128)
    return cute.make_tiled_copy_tv(atom, thr, val)


class HalfSectorPackV(prep.PackV):
    """PackV until 2026-12-04: ``sV8`` unswizzled, each thread 16 positions of one channel."""

    @cute.kernel
    def kernel(self, mV, mAmax, mVp, mDv, mEnergy):
        tidx, _, _ = cute.arch.thread_idx()
        n, h, b = cute.arch.block_idx()
        blocks, heads, batch = cute.arch.grid_dim()
        n, h, b = blocks - 1 - n, heads - 1 - h, batch - 1 - b
        smem = cutlass.memory.SmemAllocator()
        sV8 = smem.allocate_tensor(
            cutlass.Float8E4M3FN, cute.make_layout((BLOCK, HEAD_DIM), stride=(HEAD_DIM, 1)), byte_alignment=16
        )
        x = prep.load_block(mV, b, h, n, tidx).load().to(cutlass.Float32)
        scale, descale = prep._scale_and_descale(mAmax[b, h])
        tiled_copy = prep.token_major_copy(cutlass.Float8E4M3FN)
        tVsV8 = tiled_copy.get_slice(tidx).partition_D(sV8)
        tVrV8 = cute.make_rmem_tensor_like(tVsV8)
        tVrV8.store(prep._to_e4m3(x, scale))
        cute.copy(tiled_copy, tVrV8, tVsV8)
        if cutlass.const_expr(mEnergy is not None):
            prep._store_residual_energy(x, tVrV8.load(), descale, prep.block_coords(mV, n, tidx), mEnergy[b, h, None])
        cute.arch.barrier()
        sPacked = cute.make_tensor(
            sV8.iterator,
            cute.make_layout(
                (HEAD_DIM, prep.PERMUTATION_SHAPE), stride=(1, prep._scaled(prep.PERMUTATION_STRIDE, HEAD_DIM))
            ),
        )
        mVp_bh = mVp[b, h, None, None]
        gVp = cute.local_tile(cute.recast_tensor(mVp_bh, cutlass.Float8E4M3FN), (HEAD_DIM, BLOCK), (0, n))
        packed_copy = _channel_major_copy(cutlass.Float8E4M3FN, HEAD_DIM, prep.THREADS // HEAD_DIM)
        thr_packed = packed_copy.get_slice(tidx)
        tPgP = thr_packed.partition_D(gVp)
        tPrP = cute.make_rmem_tensor_like(tPgP)
        cute.autovec_copy(thr_packed.partition_S(sPacked), tPrP)
        cute.copy(packed_copy, tPrP, tPgP)
        if tidx < ONES_ROWS * (BLOCK // prep.KEYS_PER_STORE):
            ones_copy = _channel_major_copy(Uint8, ONES_ROWS, BLOCK // prep.KEYS_PER_STORE)
            gOnes = cute.local_tile(mVp_bh, (ONES_ROWS, BLOCK), (HEAD_DIM // ONES_ROWS, n))
            tOgO = ones_copy.get_slice(tidx).partition_D(gOnes)
            tOrO = cute.make_rmem_tensor_like(tOgO)
            tOrO.fill(0)
            first_key = n * BLOCK + (tidx // ONES_ROWS) * prep.KEYS_PER_STORE
            for i in cutlass.range_constexpr(prep.KEYS_PER_STORE):
                if first_key + KEY_PERMUTATION[i] < mV.shape[1]:
                    tOrO[i] = Uint8(E4M3_ONE)
            cute.copy(ones_copy, tOrO, tOgO)
        if n == 0 and tidx == 0:
            mDv[b, h] = descale


def compile_variant(kind: str):
    """``prep_ops.compile_prep(kind, DTYPE)`` with ``HalfSectorPackV``."""
    shipped = prep_ops.PackV
    prep_ops.PackV = HalfSectorPackV
    try:
        return prep_ops.compile_prep(kind, DTYPE)
    finally:
        prep_ops.PackV = shipped


def main() -> None:
    torch.manual_seed(0)
    for seq, heads in SHAPES:
        print(f"S={seq} H={heads}", flush=True)
        k, v = (torch.randn(1, seq, heads, HEAD_DIM, device="cuda", dtype=DTYPE) for _ in range(2))
        compare_pack_ways(v, k, compile_variant)


if __name__ == "__main__":
    main()
