"""Device probe: what the 700 W cap leaves each method. Power, SM clock, work per clock and energy per FLOP of
Open-VC (the kernel alone and the complete call with the processor's defaults) beside an FP8 GEMM
(``torch._scaled_mm``), FA3 FP8 and FA4 BF16, each run back to back for ``RUN_S`` seconds while nvidia-smi samples
the card every ``SAMPLE_MS``.

Per method and shape: TFLOP/s (the median CUDA-event time of the calls of the run's settled part), the median SM
clock and power of the samples in that part (the last ``SETTLED`` of the run, after the clock has come down to what
the cap allows), TFLOP/s per GHz (work per clock), pJ per FLOP (power over rate), and the SM clock at which the
method's work per clock would give ``TARGET_TFLOPS``. The methods run in a shuffled order; the peers where their
packages import (examples/bench_attention.py names them).
"""

import os
import random
import statistics
import subprocess
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from bench_attention import Unavailable, attention_flop, fa3_fp8_inputs, peer, run_fa3_fp8, run_fa4  # noqa: E402

from openvc_diffusers.config import OpenVCConfig  # noqa: E402
from openvc_kernels import attention, attention_prepared, prepare  # noqa: E402

SHAPES = ((32760, 12), (118800, 24))
GEMM_SIZE = 8192
RUN_S = 5.0
SETTLED = 0.6
SAMPLE_MS = 50
SYNC_EVERY = 8
"""Calls enqueued between synchronizations: enough to keep the GPU busy, few enough that the run ends on time."""
TARGET_TFLOPS = 1100.0
QUERY = ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", str(SAMPLE_MS)]


class Sampler:
    """nvidia-smi's samples (host time, SM MHz, W), read on a thread for as long as the probe runs."""

    def __init__(self):
        self.samples = []
        self.process = subprocess.Popen(QUERY, stdout=subprocess.PIPE, text=True)
        self.thread = threading.Thread(target=self.read, daemon=True)
        self.thread.start()

    def read(self):
        for line in self.process.stdout:
            try:
                sm, watts = (float(x) for x in line.split(","))
            except ValueError:  # "[N/A]" or a partial line
                continue
            self.samples.append((time.monotonic(), sm, watts))

    def between(self, start: float, end: float) -> list[tuple[float, float, float]]:
        return [s for s in self.samples if start <= s[0] <= end]

    def stop(self):
        self.process.terminate()


def run(fn, args) -> tuple[float, float, list[float]]:
    """``fn(*args)`` back to back for RUN_S seconds: (host time the settled part starts, ends, its calls' ms)."""
    fn(*args)
    torch.cuda.synchronize()
    start = time.monotonic()
    settled = start + (1 - SETTLED) * RUN_S
    events = []
    while time.monotonic() < start + RUN_S:
        for _ in range(SYNC_EVERY):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn(*args)
            end.record()
            events.append((time.monotonic(), begin, end))
        torch.cuda.synchronize()
    return settled, time.monotonic(), [b.elapsed_time(e) for at, b, e in events if at >= settled]


def methods(seq: int, heads: int) -> dict:
    """name -> (call, args, FLOP per call) for this shape, the peers that import."""
    q, k, v = (torch.randn(1, seq, heads, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flop = attention_flop(q, k)
    out = torch.empty_like(q)
    prepared = prepare(q, k, v)
    found = {
        "openvc_kernel": (lambda p: attention_prepared(p, out, softmax_scale=128**-0.5), [prepared], flop),
        "openvc_default": (lambda *x: attention(*x, **OpenVCConfig().kernel_options), [q, k, v], flop),
    }
    try:
        peer("fa3_fwd_interface")
        found["fa3_fp8_prequantized"] = (run_fa3_fp8, fa3_fp8_inputs(q, k, v), flop)
    except Unavailable as e:
        print(f"left out FA3 FP8: {e}")
    try:
        peer("flash_attn.cute")
        found["fa4_bf16"] = (run_fa4, [q, k, v], flop)
    except Unavailable as e:
        print(f"left out FA4: {e}")
    return found


def gemm() -> tuple:
    """FP8 E4M3 ``torch._scaled_mm`` of GEMM_SIZE^3, BF16 out (K-major B, as cuBLAS takes FP8)."""
    a = torch.randn(GEMM_SIZE, GEMM_SIZE, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(GEMM_SIZE, GEMM_SIZE, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    call = lambda a, b: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    return call, [a, b], 2.0 * GEMM_SIZE**3


def main():
    random.seed(0)
    torch.manual_seed(0)
    sampler = Sampler()
    time.sleep(1.0)
    rows = []
    work = [("fp8_gemm", f"{GEMM_SIZE}^3", gemm)]
    for seq, heads in SHAPES:
        for name, entry in methods(seq, heads).items():
            work.append((name, f"{seq}x{heads}", lambda entry=entry: entry))
    for name, shape, make in random.sample(work, len(work)):
        fn, args, flop = make()
        settled, end, ms = run(fn, args)
        samples = sampler.between(settled, end)
        if not samples:
            print(f"{name} {shape}: no nvidia-smi samples")
            continue
        rate = flop / statistics.median(ms) / 1e9
        mhz = statistics.median(s[1] for s in samples)
        watts = statistics.median(s[2] for s in samples)
        rows.append((shape, name, rate, mhz, watts, len(samples), len(ms)))
        print(f"{shape:>11} {name:22s} {rate:7.0f} TFLOP/s at {mhz:6.0f} MHz, {watts:5.0f} W", flush=True)
        torch.cuda.empty_cache()
    sampler.stop()
    head = (
        f"{'shape':>11} | {'method':22} | TFLOP/s | SM MHz |     W | TFLOP/s per GHz | pJ/FLOP | "
        f"MHz for {TARGET_TFLOPS:.0f} | samples | calls"
    )
    print(head)
    print("-" * len(head))
    for shape, name, rate, mhz, watts, n_samples, n_calls in sorted(rows):
        per_ghz = rate / (mhz / 1000)
        print(
            f"{shape:>11} | {name:22} | {rate:7.0f} | {mhz:6.0f} | {watts:5.0f} | {per_ghz:15.0f} | "
            f"{watts / rate:7.3f} | {TARGET_TFLOPS / per_ghz * 1000:8.0f} | {n_samples:7d} | {n_calls:5d}"
        )


if __name__ == "__main__":
    main()
