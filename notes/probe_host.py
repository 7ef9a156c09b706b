"""Device probe: where the host time of a complete Open-VC call goes, API against the processor's defaults.

At a small shape (``SMALL``: the GPU work is a few microseconds, so the host never waits for it) each step of
``openvc_kernels.attention`` is wrapped in a wall-clock timer (``STEPS``) and the call is made ``CALLS`` times: per
step, its host microseconds per call, inclusive of the steps inside it. Then the primitives those steps are made
of (an allocation, a zero fill, a view of one allocation, a stream's fork and join, a kernel launch through
tvm-ffi), each timed alone. Medians of ``REPEATS`` runs.
"""

import collections
import functools
import statistics
import time

import torch

from openvc_diffusers.config import OpenVCConfig
from openvc_kernels import attention, ops, prep_ops
from openvc_kernels.quant import BLOCK
from openvc_kernels.sm90.layout import HEAD_DIM

SMALL = (2048, 2)
CALLS = 200
REPEATS = 5
STEPS = {
    ops: ("_check_kernel_args", "_prepare_checked", "attention_prepared", "forward_args", "_split_workspace"),
    prep_ops: (
        "load_kernels", "kernel_ready", "_launch_absmax", "empty_prepared", "_launch_pack", "repair_score",
        "smoothing_mean", "_launch_k", "load_prep",
    ),
}


def host_us(fn, calls: int = CALLS) -> float:
    """Median over ``REPEATS`` of the wall time per call of ``calls`` calls of ``fn``, synchronized between runs."""
    fn()
    runs = []
    for _ in range(REPEATS):
        torch.cuda.synchronize()
        start = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter_ns() - start) / calls / 1e3)
        torch.cuda.synchronize()
    return statistics.median(runs)


def step_breakdown(options: dict, inputs) -> dict[str, float]:
    """Host microseconds per call in each of ``STEPS`` (inclusive), and the whole call."""
    spent = collections.Counter()
    originals = {}
    for module, names in STEPS.items():
        for name in names:
            original = getattr(module, name)
            originals[module, name] = original

            def timed(*args, _original=original, _name=name, **kwargs):
                start = time.perf_counter_ns()
                try:
                    return _original(*args, **kwargs)
                finally:
                    spent[_name] += time.perf_counter_ns() - start

            setattr(module, name, timed)
    try:
        attention(*inputs, **options)
        torch.cuda.synchronize()
        spent.clear()
        whole = host_us(lambda: attention(*inputs, **options))
        calls = CALLS * (REPEATS + 1)
    finally:
        for (module, name), original in originals.items():
            setattr(module, name, original)
    return {"call (with the timers)": whole, **{name: ns / calls / 1e3 for name, ns in spent.items()}}


def primitives(seq: int, heads: int) -> dict[str, float]:
    device = torch.device("cuda")
    n = seq // BLOCK
    here, aside = torch.cuda.current_stream(), torch.cuda.Stream(priority=-1)
    fork, join = torch.cuda.Event(), torch.cuda.Event()
    pool = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    sums = torch.randn(1, heads, n, HEAD_DIM, device=device)
    mean = torch.empty(1, heads, HEAD_DIM, device=device)
    channel_mean = prep_ops.load_prep("channel_mean")

    def fork_join_reused():
        fork.record(here)
        aside.wait_event(fork)
        join.record(aside)
        here.wait_event(join)

    def set_stream_twice():
        torch.cuda.set_stream(aside)
        torch.cuda.set_stream(here)

    return {
        "torch.empty (1, H, n) fp32": host_us(lambda: torch.empty(1, heads, n, dtype=torch.float32, device=device)),
        "torch.zeros (1, H) fp32": host_us(lambda: torch.zeros(1, heads, dtype=torch.float32, device=device)),
        "view of one allocation (slice, dtype, shape)": host_us(
            lambda: pool[4096:4096 + 4 * heads * n].view(torch.float32).view(1, heads, n)
        ),
        "wait_stream there and back (2 new events)": host_us(lambda: (aside.wait_stream(here), here.wait_stream(aside))),
        "two reused events recorded and waited": host_us(fork_join_reused),
        "torch.cuda.set_stream there and back": host_us(set_stream_twice),
        "torch.cuda.current_stream": host_us(lambda: torch.cuda.current_stream(device)),
        "load_prep lookup": host_us(lambda: prep_ops.load_prep("channel_mean")),
        "a tvm-ffi launch (ChannelMean, 3 args)": host_us(lambda: channel_mean(sums, mean, seq)),
        "functools.cache lookup (ops.sm_count)": host_us(functools.partial(ops.sm_count, device)),
    }


def main():
    print(torch.cuda.get_device_name(), torch.__version__)
    seq, heads = SMALL
    inputs = [torch.randn(1, seq, heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    rows = {name: step_breakdown(options, inputs) for name, options in
            (("api", {}), ("defaults", OpenVCConfig().kernel_options))}
    print(f"S={seq} H={heads}: host us per call, inclusive (the timers add about 0.3 us each)")
    print(f"  {'step':40s} {'api':>8s} {'defaults':>9s}")
    for step in dict.fromkeys([*rows["api"], *rows["defaults"]]):
        api, defaults = rows["api"].get(step, 0.0), rows["defaults"].get(step, 0.0)
        print(f"  {step:40s} {api:8.1f} {defaults:9.1f}")
    plain = {name: host_us(lambda o=options: attention(*inputs, **o)) for name, options in
             (("api", {}), ("defaults", OpenVCConfig().kernel_options))}
    print(f"  {'call (no timers)':40s} {plain['api']:8.1f} {plain['defaults']:9.1f}")
    print("primitives: host us each")
    for name, us in primitives(seq, heads).items():
        print(f"  {name:48s} {us:7.2f}")


if __name__ == "__main__":
    main()
