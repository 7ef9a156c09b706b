"""Device probe: where a complete Open-VC call's time goes, kernel by kernel, gaps included (torch.profiler).

Runs ``openvc_kernels.attention`` back to back at the bench shapes and prints, per GPU operation of one call
(in stream order), its median duration and the median idle gap before it; then the call's span.
"""

import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from openvc_kernels import attention

CALLS = 12


def profile_shape(seq: int, heads: int) -> None:
    sets = [[torch.randn(1, seq, heads, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3)] for _ in range(2)]
    for s in sets:
        attention(*s)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(CALLS):
            attention(*sets[i % 2])
        torch.cuda.synchronize()
    kernels = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    per_call = len(kernels) // CALLS
    rows = {}
    for i, e in enumerate(kernels[per_call:], start=per_call):  # the first call waits on nothing before it
        gap = e.time_range.start - kernels[i - 1].time_range.end
        rows.setdefault(i % per_call, (e.name, [], []))[1].append(e.time_range.elapsed_us())
        rows[i % per_call][2].append(gap)
    span = statistics.median(
        kernels[(c + 1) * per_call].time_range.start - kernels[c * per_call].time_range.start for c in range(CALLS - 1)
    )
    print(f"{seq}x{heads}: {per_call} GPU operations per call, call span {span / 1e3:.3f} ms")
    for name, durations, gaps in rows.values():
        print(f"  {statistics.median(durations):9.1f} us  gap before {statistics.median(gaps):6.1f} us  {name[:90]}")
    sys.stdout.flush()


def main():
    print(torch.cuda.get_device_name())
    for seq, heads in ((32760, 12), (73397, 7)):
        profile_shape(seq, heads)


if __name__ == "__main__":
    main()
