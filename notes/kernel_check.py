"""One process, on a Hopper GPU: which CUDA flavor of the CuTe DSL loaded, how long the kernels took to compile,
whether the complete call matches the reference, and its speed at 32,760 x 12 (median of CUDA-event-timed calls).

    python notes/kernel_check.py          # with a fresh $OPENVC_KERNEL_CACHE, to time the compile

notes/device_run.sh's `flavor` stage runs it with the DSL's CUDA 13 flavor and with its CUDA 12 flavor alone.
"""

import statistics
import time

import torch

import openvc_kernels
from openvc_diffusers.metrics import rel_l2
from openvc_kernels.compile_cache import dsl_flavor
from openvc_kernels.ops import sm_count


def main() -> None:
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), {torch.cuda.get_device_name()}")
    print(f"DSL flavor: {dsl_flavor()}")
    q, k, v = (torch.randn(2, 4096, 3, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    start = time.perf_counter()
    out = openvc_kernels.attention(q, k, v)
    torch.cuda.synchronize()
    print(f"first call (compile or load, then run): {time.perf_counter() - start:.1f} s")
    ref = openvc_kernels.reference_attention(q, k, v, accumulation="wgmma", sm_count=sm_count(q.device))
    print(f"rel-L2 against the wgmma reference at 2 x 4096 x 3: {rel_l2(out, ref):.2e}")

    q, k, v = (torch.randn(1, 32760, 12, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    times = []
    for _ in range(30):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        begin.record()
        openvc_kernels.attention(q, k, v)
        end.record()
        torch.cuda.synchronize()
        times.append(begin.elapsed_time(end))
    ms = statistics.median(times[5:])
    print(f"32,760 x 12 complete call: {ms:.3f} ms, {4 * 32760**2 * 12 * 128 / ms / 1e9:.0f} TFLOP/s")


if __name__ == "__main__":
    main()
