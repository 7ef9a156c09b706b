"""Device probe: why the processor's defaults cost more over the API call when the bench's synchronized timing
interleaves the two (``bench_attention.time_interleaved``) than when it times each apart, at one shape.

Each call is made alone (synchronize, event, call, event), as the bench's "synced" timing makes it, ``CALLS`` calls
per schedule: "apart" (all API calls, then all defaults calls) and "interleaved" (API, defaults, defaults, API, ...).
Per schedule and method: the median call time, the caching allocator's device allocations and frees during the
schedule (``torch.cuda.memory_stats``: a cudaMalloc inside a timed call would show there), and from torch.profiler
the median time from the call's first GPU operation to the forward kernel's start, how much of it the GPU sat
idle, and the forward kernel's own duration. Run on a Hopper GPU: ``python notes/probe_synced_pair.py [S H]``.
"""

import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from openvc_diffusers.config import OpenVCConfig
from openvc_kernels import attention
from profile_call import forward_lead

CALLS = 60
PROFILED_CALLS = 16
OPTIONS = {"api": {}, "defaults": OpenVCConfig().kernel_options}
ALLOCATOR_STATS = ("num_device_alloc", "num_device_free", "num_alloc_retries")


def schedule(kind: str, calls: int) -> list[str]:
    if kind == "apart":
        return ["api"] * calls + ["defaults"] * calls
    return [name for i in range(calls) for name in (("api", "defaults") if i % 2 == 0 else ("defaults", "api"))]


def timed(order: list[str], sets) -> dict[str, list[float]]:
    times = {name: [] for name in OPTIONS}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for i, name in enumerate(order):
        torch.cuda.synchronize()
        start.record()
        attention(*sets[(i // 2) % 2], **OPTIONS[name])
        end.record()
        torch.cuda.synchronize()
        times[name].append(start.elapsed_time(end))
    return times


def profiled(order: list[str], sets) -> dict[str, tuple[float, float, float]]:
    """Per method: median lead (first GPU operation to the forward kernel's start), idle part of it, kernel time."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i, name in enumerate(order):
            torch.cuda.synchronize()
            attention(*sets[(i // 2) % 2], **OPTIONS[name])
            torch.cuda.synchronize()
    ops = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda e: e.time_range.start)
    found = {name: ([], [], []) for name in OPTIONS}
    first = 0
    for name in order:
        lead, idle, forward = forward_lead(ops[first:])
        forward += first
        for values, value in zip(found[name], (lead, idle, ops[forward].time_range.elapsed_us())):
            values.append(value)
        first = forward + 1
    return {name: tuple(statistics.median(v[1:]) for v in values) for name, values in found.items()}


def main() -> None:
    seq, heads = (int(a) for a in sys.argv[1:3]) if len(sys.argv) > 2 else (32_760, 12)
    print(torch.cuda.get_device_name(), f"{seq}x{heads}", flush=True)
    sets = [[torch.randn(1, seq, heads, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3)] for _ in range(2)]
    for name in OPTIONS:
        attention(*sets[0], **OPTIONS[name])
    for rnd in range(2):
        for kind in ("apart", "interleaved") if rnd == 0 else ("interleaved", "apart"):
            before = torch.cuda.memory_stats()
            times = timed(schedule(kind, CALLS), sets)
            after = torch.cuda.memory_stats()
            allocator = ", ".join(f"{key} +{after.get(key, 0) - before.get(key, 0)}" for key in ALLOCATOR_STATS)
            ms = {name: statistics.median(t) for name, t in times.items()}
            print(f"round {rnd} {kind:>11}: api {ms['api']:.3f} ms, defaults {ms['defaults']:.3f} ms "
                  f"({100 * (ms['defaults'] / ms['api'] - 1):+.2f}%); allocator: {allocator}", flush=True)
            for name, (lead, idle, kernel) in profiled(schedule(kind, PROFILED_CALLS), sets).items():
                print(f"    {name:>8}: forward kernel starts {lead:6.1f} us after the first GPU operation "
                      f"({idle:5.1f} us idle), runs {kernel / 1e3:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
