"""Time the sm90 preparation at Wan 14B 720p (S = 75,600, H = 40, bf16) against a device copy; prints JSON.

Run on a Hopper GPU: ``python notes/bench_sm90_prep.py``. Bytes count reads plus writes.

``python notes/bench_sm90_prep.py --smoke KIND`` (KIND: quantize_per_block, absmax_per_head, pack_v) compiles
and launches that one kernel alone, synchronizes and compares with the PyTorch reference at a few small
shapes, printing a line after every step; run each KIND in its own process under ``timeout 60``
(notes/prep.md, "Hang analysis").
"""

import faulthandler
import json
import os
import sys
import time

import torch

from openvc_kernels.quant import BLOCK, num_blocks, quantize_per_block, quantize_per_head
from openvc_kernels.sm90 import prep
from openvc_kernels.sm90.layout import PV_N, pack_v, prepare_reference

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
            lambda: prep.load_prep("quantize_per_block", q.dtype)(q, out.q8, out.d_q),
            x_bytes + x8_bytes,
        ),
        "absmax_per_head (V)": (lambda: prep.load_prep("absmax_per_head", v.dtype)(v, amax), x_bytes),
        "pack_v (V)": (
            lambda: prep.load_prep("pack_v", v.dtype)(v, unit_amax, out.v_packed, out.d_v),
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


SMOKE_SHAPES = ((1, 1, 1), (1, 129, 3), (2, 4100, 12))
"""(B, S, H): the first GPU test's shape (the one that hung), a partial second block, several blocks."""


def smoke(kind: str) -> None:
    """One kernel alone: compile, launch, synchronize, compare bytes; a print after each step."""
    faulthandler.dump_traceback_later(float(os.environ.get("SMOKE_WATCHDOG_S", 45)), exit=True)
    say = lambda **kw: print(json.dumps({"kind": kind, **kw}), flush=True)
    t = time.perf_counter()
    fn = prep.load_prep(kind, torch.bfloat16)
    say(step="compiled", s=round(time.perf_counter() - t, 2))
    for batch, seq_len, heads in SMOKE_SHAPES:
        shape = dict(B=batch, S=seq_len, H=heads)
        x = torch.randn(batch, seq_len, heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        ref = prepare_reference(x, x, x)
        out = prep.empty_prepared(batch, seq_len, seq_len, heads, "cuda")
        for buf in out[:-1]:
            buf.view(torch.uint8).fill_(0x7F)
        xk = prep._kernel_ready(x)
        torch.cuda.synchronize()
        say(step="launch", **shape)
        if kind == "quantize_per_block":
            fn(xk, out.q8, out.d_q)
        elif kind == "absmax_per_head":
            amax = torch.zeros(batch, heads, device="cuda")
            fn(xk, amax)
        else:
            amax = x.float().abs().amax(dim=(1, 3))  # what absmax_per_head computes, exactly
            fn(xk, amax, out.v_packed, out.d_v)
        say(step="launched (async)", **shape)
        torch.cuda.synchronize()
        say(step="synchronized", **shape)
        if kind == "quantize_per_block":
            same = torch.equal(out.q8, ref.q8) and torch.equal(out.d_q.view(torch.int32), ref.d_q.view(torch.int32))
        elif kind == "absmax_per_head":
            same = torch.equal(amax, x.float().abs().amax(dim=(1, 3)))
        else:
            same = torch.equal(out.v_packed, ref.v_packed)
            same = same and torch.equal(out.d_v.view(torch.int32), ref.d_v.view(torch.int32))
        say(step="compared", identical=bool(same), **shape)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--smoke":
        smoke(sys.argv[2])
    else:
        main()
