"""Device probe: where a complete Open-VC call's time goes, kernel by kernel, gaps included (torch.profiler).

Runs ``openvc_kernels.attention`` back to back at the bench shapes, with the API's defaults and with the
processor's (``OpenVCConfig().kernel_options``), and prints per GPU operation of one call (in the order they
start) its median duration and the median gap before it (from the end of the operation that started last before
it; negative where one runs beside the one before it); then the call's span and its host time (the calls
enqueued after a synchronize, wall time per call), and for calls made each alone how long the GPU waits for the
forward kernel's launch. At ``HOST_PROFILE_SHAPE`` also where that host time goes: cProfile's functions of most
own time over the same calls.
"""

import collections
import cProfile
import pstats
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from openvc_diffusers.config import OpenVCConfig
from openvc_kernels import attention

CALLS = 12
SHAPES = ((32760, 12), (73397, 7), (75600, 40), (118800, 24))
OPTIONS = {"api": {}, "defaults": OpenVCConfig().kernel_options}
HOST_PROFILE_SHAPE = (32760, 12)
HOST_PROFILE_LINES = 22


def host_ms(call, inputs) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(CALLS):
        call(*inputs[i % 2])
    host = (time.perf_counter() - start) / CALLS * 1e3
    torch.cuda.synchronize()
    return host


def profile_call(seq: int, heads: int, name: str) -> None:
    options = OPTIONS[name]
    sets = [[torch.randn(1, seq, heads, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3)] for _ in range(2)]

    def call(q, k, v):
        return attention(q, k, v, **options)

    for s in sets:
        call(*s)
    host = host_ms(call, sets)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(CALLS):
            call(*sets[i % 2])
        torch.cuda.synchronize()
    kernels = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    per_call = len(kernels) // CALLS
    rows = {}
    for c in range(1, CALLS):  # the first call waits on nothing before it
        # Keyed by kernel and occurrence, not position: operations that run beside each other start in varying order.
        occurrences = collections.Counter()
        for i in range(c * per_call, (c + 1) * per_call):
            e = kernels[i]
            occurrences[e.name] += 1
            key = (e.name, occurrences[e.name])
            gap = e.time_range.start - kernels[i - 1].time_range.end
            rows.setdefault(key, (e.name, [], []))[1].append(e.time_range.elapsed_us())
            rows[key][2].append(gap)
    span = statistics.median(
        kernels[(c + 1) * per_call].time_range.start - kernels[c * per_call].time_range.start for c in range(CALLS - 1)
    )
    tflops = 4 * seq * seq * heads * 128 / (span * 1e-6) / 1e12
    print(
        f"{seq}x{heads} {name}: {per_call} GPU operations per call, call span {span / 1e3:.3f} ms "
        f"({tflops:.0f} TFLOP/s), host {host:.3f} ms per call"
    )
    forward = 0.0
    for name_, durations, gaps in rows.values():
        duration, gap = statistics.median(durations), statistics.median(gaps)
        if "ExpCastAttentionSm90" in name_:
            forward = duration
        print(f"  {duration:9.1f} us  gap before {gap:6.1f} us  {name_[:90]}")
    print(f"  outside the forward kernel (the call's span less the kernel's): {span - forward:.1f} us")
    synced_lead(call, sets, per_call)
    if (seq, heads) == HOST_PROFILE_SHAPE:
        host_profile(call, sets)
    sys.stdout.flush()


def forward_lead(ops: list) -> tuple[float, float, int]:
    """For one call's GPU operations (profiler events in start order, the forward kernel among them): the time from the
    first one to the forward kernel's start, how much of it the GPU sat idle (waiting for the host's launches;
    overlapping operations count once), and the forward kernel's index in ``ops``."""
    forward = next(i for i, e in enumerate(ops) if "ExpCastAttentionSm90" in e.name)
    busy_until, busy = ops[0].time_range.start, 0.0
    for e in ops[:forward]:
        start, end = max(e.time_range.start, busy_until), e.time_range.end
        busy, busy_until = busy + max(0.0, end - start), max(busy_until, end)
    lead = ops[forward].time_range.start - ops[0].time_range.start
    return lead, lead - busy, forward


def synced_lead(call, sets, per_call: int) -> None:
    """Calls made each alone (synchronize, call), as the bench's synchronized timing makes them: the median time
    from the call's first GPU operation to the forward kernel's start, and how much of it the GPU sat idle (waiting
    for the host's launches)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(CALLS):
            torch.cuda.synchronize()
            call(*sets[i % 2])
        torch.cuda.synchronize()
    kernels = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    leads, idles = [], []
    for c in range(1, CALLS):
        lead, idle, _ = forward_lead(kernels[c * per_call:(c + 1) * per_call])
        leads.append(lead)
        idles.append(idle)
    print(
        f"  synchronized calls: the forward kernel starts {statistics.median(leads):.1f} us after the call's first "
        f"GPU operation, {statistics.median(idles):.1f} us of it idle"
    )


def host_profile(call, sets) -> None:
    """cProfile over CALLS calls enqueued after a synchronize: the functions of most own time, per call."""
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for i in range(CALLS):
        call(*sets[i % 2])
    profiler.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profiler)
    rows = sorted(stats.stats.items(), key=lambda item: -item[1][2])[:HOST_PROFILE_LINES]
    print("  host, per call: own us, cumulative us, calls, function")
    for (file, line, function), (_, calls, own, cumulative, _) in rows:
        where = f"{file.rsplit('/', 1)[-1]}:{line}" if line else file
        print(f"  {own / CALLS * 1e6:8.1f} {cumulative / CALLS * 1e6:9.1f} {calls // CALLS:4d}  {function} ({where})")


def main():
    print(torch.cuda.get_device_name())
    for seq, heads in SHAPES:
        for name in OPTIONS:
            profile_call(seq, heads, name)


if __name__ == "__main__":
    main()
