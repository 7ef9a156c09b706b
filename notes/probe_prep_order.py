"""Device probe: two changes to the preparation's memory traffic, each against the way before it, in one process.

  packed V, last read first   PackV's CTAs take V's blocks in the reverse of V's absmax launch's order
                              (``PackV(last_read_first=True)``, shipped) or in the same order (False): timed as the
                              pair that runs in a call, V's absmax (with K's block sums for the defaults) then
                              packed V (with the energies for the defaults)
  repair rows                 RepairRows quantizing V8 again from V (shipped) or gathering it a byte at a time from
                              packed V (``GatheringRepairRows``, the kernel until 2026-12-02); each call after a
                              64 MiB fill that pushes the real keys out of L2, as in a call, where Q's and K's
                              quantization run in between

Both ways of each must write the same bytes (checked first). Then each pair of ways is timed interleaved call by
call (``bench_attention.time_interleaved``, back to back): each one's median us and the shipped way's time over the
other's (the median over rounds of the ratio within a round).
"""

import os
import statistics
import sys

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Uint8

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from bench_attention import median_over, time_interleaved  # noqa: E402

from openvc_kernels import prep_ops  # noqa: E402
from openvc_kernels.preparation import PrepareOptions  # noqa: E402
from openvc_kernels.quant import BLOCK  # noqa: E402
from openvc_kernels.repair import repair_count  # noqa: E402
from openvc_kernels.sm90 import prep  # noqa: E402
from openvc_kernels.sm90.layout import HEAD_DIM, ONES_ROWS, PV_N  # noqa: E402
from openvc_kernels.sm90.ptx import mul_rn  # noqa: E402
from openvc_kernels.sm90.target import COMPILE_OPTIONS, row_major_fake  # noqa: E402

SHAPES = ((32760, 12), (73397, 7), (75600, 40))
BUDGET_MS = 2000
REPAIR_RATIO = 0.005
DTYPE = torch.bfloat16
SCRUB_BYTES = 64 << 20


class GatheringRepairRows(prep.RepairRows):
    """RepairRows until 2026-12-02: V8 read back from packed V, one byte per channel, and the K row a byte at a time."""

    @cute.jit
    def __call__(self, mV, mTokens, mK8, mDk, mVp, mDv, mDkRepair, mTileRepair, stream):
        self.kernel(mV, mTokens, mK8, mDk, mVp, mDv, mDkRepair, mTileRepair).launch(
            grid=[mDkRepair.shape[2] // prep.REPAIR_KEYS_PER_CTA, mDkRepair.shape[1], mDkRepair.shape[0]],
            block=[prep.THREADS, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mV, mTokens, mK8, mDk, mVp, mDv, mDkRepair, mTileRepair):
        tidx, _, _ = cute.arch.thread_idx()
        n, h, b = cute.arch.block_idx()
        key = n * prep.REPAIR_KEYS_PER_CTA + tidx // prep.REPAIR_THREADS_PER_KEY
        first_channel = (tidx % prep.REPAIR_THREADS_PER_KEY) * prep.REPAIR_CHANNELS
        s_pad = mDk.shape[2] * BLOCK
        row = s_pad + key
        column = s_pad + prep._packed_position(key)
        residual8 = cute.make_rmem_tensor(prep.REPAIR_CHANNELS, cutlass.Float8E4M3FN)
        residual8_bytes = cute.recast_tensor(residual8, Uint8)
        if key < mTokens.shape[2]:
            token = Int32(mTokens[b, h, key])
            tile = token // BLOCK
            d_v = mDv[b, h]
            v8 = cute.make_rmem_tensor(prep.REPAIR_CHANNELS, cutlass.Float8E4M3FN)
            v8_bytes = cute.recast_tensor(v8, Uint8)
            token_column = prep._packed_position(token)
            for c in cutlass.range(prep.REPAIR_CHANNELS, unroll_full=True):
                channel = first_channel + c
                mK8[b, h, row, channel] = mK8[b, h, token, channel]
                v8_bytes[c] = mVp[b, h, channel, token_column]
            decoded = cute.make_rmem_tensor(prep.REPAIR_CHANNELS, Float32)
            decoded.store(v8.load().to(Float32))
            residual = cute.make_rmem_tensor(prep.REPAIR_CHANNELS, Float32)
            for c in cutlass.range(prep.REPAIR_CHANNELS, unroll_full=True):
                value = Float32(mV[b, token, h, first_channel + c]) - mul_rn(d_v, decoded[c])
                residual[c] = value / d_v
            residual8.store(residual.load().to(cutlass.Float8E4M3FN))
            if tidx % prep.REPAIR_THREADS_PER_KEY == 0:
                mDkRepair[b, h, key] = mDk[b, h, tile]
                mTileRepair[b, h, key] = tile
        else:
            residual8_bytes.fill(0)
            for c in cutlass.range(prep.REPAIR_CHANNELS, unroll_full=True):
                mK8[b, h, row, first_channel + c] = Uint8(0)
            if tidx % prep.REPAIR_THREADS_PER_KEY == 0:
                mDkRepair[b, h, key] = Float32(0.0)
                mTileRepair[b, h, key] = Int32(0)
        for c in cutlass.range(prep.REPAIR_CHANNELS, unroll_full=True):
            mVp[b, h, first_channel + c, column] = residual8_bytes[c]
        if tidx % prep.REPAIR_THREADS_PER_KEY == 0:
            for i in cutlass.range_constexpr(ONES_ROWS):
                mVp[b, h, HEAD_DIM + i, column] = Uint8(0)


def compile_gathering_repair_rows():
    """``prep_ops.compile_prep("repair_rows", DTYPE)``'s arguments less V's absmax, for ``GatheringRepairRows``."""
    b, h = cute.sym_int(), cute.sym_int()
    s_all, n_k, repair_keys = cute.sym_int(divisibility=BLOCK), cute.sym_int(), cute.sym_int(divisibility=BLOCK)
    return cute.compile(
        GatheringRepairRows(), prep_ops.input_fake(prep_ops.TORCH_TO_CUTLASS[DTYPE]),
        row_major_fake(cutlass.Int64, (b, h, cute.sym_int()), 8),
        row_major_fake(Uint8, (b, h, s_all, HEAD_DIM), 16), row_major_fake(Float32, (b, h, n_k), 4),
        row_major_fake(Uint8, (b, h, PV_N, s_all), 16), row_major_fake(Float32, (b, h), 4),
        row_major_fake(Float32, (b, h, repair_keys), 4), row_major_fake(cutlass.Int32, (b, h, repair_keys), 4),
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True), options=COMPILE_OPTIONS,
    )


def compile_pack_in_launch_order(kind: str):
    """``prep_ops.compile_prep(kind, DTYPE)`` with ``PackV(last_read_first=False)``."""
    shipped = prep_ops.PackV
    prep_ops.PackV = lambda: shipped(last_read_first=False)
    try:
        return prep_ops.compile_prep(kind, DTYPE)
    finally:
        prep_ops.PackV = shipped


def report(label: str, shipped: list[float], before: list[float]) -> None:
    print(
        f"  {label:34s} shipped {1e3 * statistics.median(shipped):7.1f} us, before {1e3 * statistics.median(before):7.1f}"
        f" us: {100 * median_over(shipped, before):+6.2f}%",
        flush=True,
    )


def probe_pack_order(v, k):
    """V's absmax then packed V, each way, for the API's kinds and the defaults' (K's sums, the energies)."""
    compare_pack_ways(v, k, compile_pack_in_launch_order)


def compare_pack_ways(v, k, compile_before) -> None:
    """V's absmax then packed V, with the shipped PackV and with ``compile_before(kind)``'s, for the API's kinds and
    the defaults' (K's sums, the energies): whether both write the same bytes, then ``report``'s times."""
    batch, seq, heads, _ = v.shape
    s_pad = prep_ops.num_blocks(seq) * BLOCK
    amax = torch.zeros(batch, heads, device="cuda")
    sums = prep_ops._empty_block_sums(k)
    for label, absmax, kind in (
        ("API: absmax, pack_v", lambda: prep_ops.load_prep("absmax_per_head", DTYPE)(v, amax), "pack_v"),
        ("defaults: absmax + sums, pack_v_energy",
         lambda: prep_ops.load_prep("absmax_and_channel_sums", DTYPE)(v, k, amax, sums, None, None),
         "pack_v_energy"),
    ):
        outputs, calls = [], []
        for pack in (prep_ops.load_prep(kind, DTYPE), compile_before(kind)):
            packed = torch.full((batch, heads, PV_N, s_pad), 0x7F, dtype=torch.uint8, device="cuda")
            d_v = torch.full((batch, heads), float("nan"), device="cuda")
            energy = torch.full((batch, heads, seq), float("nan"), device="cuda") if kind == "pack_v_energy" else None
            absmax()
            pack(v, amax, packed, d_v, energy)
            outputs.append([packed, d_v.view(torch.int32)] + ([] if energy is None else [energy.view(torch.int32)]))

            def call(i, pack=pack, packed=packed, d_v=d_v, energy=energy):
                absmax()
                pack(v, amax, packed, d_v, energy)

            calls.append(call)
        same = all(torch.equal(a, b) for a, b in zip(*outputs))
        print(f"  {label}: the same bytes both ways {same}", flush=True)
        report(label, *time_interleaved(calls, [[0], [1]], "back_to_back", BUDGET_MS))


def probe_repair_rows(q, k, v):
    """RepairRows each way on one preparation's real keys and tokens, after a fill that evicts them from L2."""
    options = PrepareOptions(repair_ratio=REPAIR_RATIO)
    count = repair_count(v.shape[1], REPAIR_RATIO)
    prepared = prep_ops.prepare(q, k, v, options)
    tokens = torch.topk(torch.rand(v.shape[0], v.shape[2], v.shape[1], device="cuda"), count, dim=-1).indices
    amax = v.float().abs().amax(dim=(1, 3))
    scrub = torch.empty(SCRUB_BYTES, dtype=torch.uint8, device="cuda")
    shipped, gathering = prep_ops.load_prep("repair_rows", DTYPE), compile_gathering_repair_rows()
    ways = (
        lambda out: shipped(v, amax, tokens, out.k8, out.d_k, out.v_packed, out.d_v, out.d_k_repair, out.tile_repair),
        lambda out: gathering(v, tokens, out.k8, out.d_k, out.v_packed, out.d_v, out.d_k_repair, out.tile_repair),
    )
    outputs = []
    for way in ways:
        out = prepared._replace(
            k8=prepared.k8.clone(), v_packed=prepared.v_packed.clone(),
            d_k_repair=torch.full_like(prepared.d_k_repair, float("nan")),
            tile_repair=torch.full_like(prepared.tile_repair, -1),
        )
        way(out)
        outputs.append(out)
    same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in
               ((outputs[0].k8, outputs[1].k8), (outputs[0].v_packed, outputs[1].v_packed),
                (outputs[0].d_k_repair, outputs[1].d_k_repair), (outputs[0].tile_repair, outputs[1].tile_repair)))
    print(f"  repair rows ({count} keys): the same bytes both ways {same}", flush=True)

    def call(i, way, out):
        scrub.fill_(i & 0xFF)
        way(out)

    scrub_only = time_interleaved([lambda i: scrub.fill_(i & 0xFF)], [[0], [1]], "back_to_back", BUDGET_MS / 4)[0]
    times = time_interleaved(
        [lambda i, w=w, o=o: call(i, w, o) for w, o in zip(ways, outputs)], [[0], [1]], "back_to_back", BUDGET_MS
    )
    fill = statistics.median(scrub_only)
    print(f"  (each call with the fill, {1e3 * fill:.1f} us alone; less the fill: shipped "
          f"{1e3 * (statistics.median(times[0]) - fill):.1f} us, before {1e3 * (statistics.median(times[1]) - fill):.1f}"
          " us)", flush=True)
    report("repair rows, with the fill", *times)


def main():
    torch.manual_seed(0)
    for seq, heads in SHAPES:
        print(f"S={seq} H={heads}", flush=True)
        q, k, v = (torch.randn(1, seq, heads, HEAD_DIM, device="cuda", dtype=DTYPE) for _ in range(3))
        probe_pack_order(v, k)
        probe_repair_rows(q, k, v)


if __name__ == "__main__":
    main()
