"""Time the sm90 preparation at Wan 14B 720p (S = 75,600, H = 40, bf16) against a device copy; prints JSON.

Run on a Hopper GPU: ``python tests/bench_sm90_prep.py``. Bytes count reads plus writes.
"""

import faulthandler
import json

import torch

from openvc_kernels.quant import BLOCK, num_blocks, quantize_per_block, quantize_per_head
from openvc_kernels.sm90 import prep
from openvc_kernels.sm90.layout import PV_N, pack_v

BATCH, SEQ_LEN, HEADS, HEAD_DIM = 1, 75_600, 40, 128
ITERS = 20
WATCHDOG_S = 120
"""A hung launch prints every thread's Python stack and exits instead of holding the GPU."""


def _ms(fn) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(ITERS):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / ITERS


def main() -> None:
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    print(json.dumps({"device": torch.cuda.get_device_name()}), flush=True)
    shape = (BATCH, SEQ_LEN, HEADS, HEAD_DIM)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = prep.prepare(q, k, v)
    torch.cuda.synchronize()
    print(json.dumps({"compiled and ran": True}), flush=True)
    amax = torch.zeros(BATCH, HEADS, device="cuda")
    unit_amax = torch.ones(BATCH, HEADS, device="cuda")
    x_bytes = q.numel() * q.element_size()
    s_pad = num_blocks(SEQ_LEN) * BLOCK
    x8_bytes = BATCH * HEADS * s_pad * HEAD_DIM
    packed_bytes = BATCH * HEADS * PV_N * s_pad

    copy_dst = torch.empty_like(q)
    kernels = {
        "copy (torch, one input)": (lambda: copy_dst.copy_(q), 2 * x_bytes),
        "quantize_per_block (Q)": (
            lambda: prep.compile_prep("quantize_per_block", q.dtype)(q, out.q8, out.d_q),
            x_bytes + x8_bytes,
        ),
        "absmax_per_head (V)": (lambda: prep.compile_prep("absmax_per_head", v.dtype)(v, amax), x_bytes),
        "pack_v (V)": (
            lambda: prep.compile_prep("pack_v", v.dtype)(v, unit_amax, out.v_packed, out.d_v),
            x_bytes + packed_bytes,
        ),
        "prepare (all four)": (lambda: prep.prepare_into(q, k, v, out), 4 * x_bytes + 2 * x8_bytes + packed_bytes),
    }
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        prep.prepare_into(q, k, v, out)
    kernels["prepare, CUDA graph replay"] = (graph.replay, kernels["prepare (all four)"][1])
    print(json.dumps({"captured": True}), flush=True)

    def torch_reference():
        quantize_per_block(q.transpose(1, 2))
        quantize_per_block(k.transpose(1, 2))
        pack_v(quantize_per_head(v.transpose(1, 2))[0])

    for name, (fn, nbytes) in kernels.items():
        ms = _ms(fn)
        print(json.dumps({name: {"ms": round(ms, 4), "GB/s": round(nbytes / ms / 1e6, 1)}}), flush=True)
    print(json.dumps({"torch reference prepare": {"ms": round(_ms(torch_reference), 3)}}), flush=True)


if __name__ == "__main__":
    main()
