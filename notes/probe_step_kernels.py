"""Device probe: which kernels make a 480p eager step's time alternate in ``examples/bench_pipeline.py`` (2026-12-04:
every backend's steps 4-8% apart, odd against even; Open-VC's self-attention 170 against 185 ms).

Per backend (``openvc`` and ``fa4`` by default, in turn on one model) the bench's own path: its processor, one warm-up
step, ``empty_cache``, then STEPS Euler steps (``denoise``, a synchronize after each) under torch.profiler. The kernels
are cut into steps (every step launches the same kernels) and the table gives each step's milliseconds for the
kernels of most GPU time, then its busy time, span and idle time. For Open-VC it also keeps the first self-attention
call's inputs of every step (clones, each at an address of its own) and times the kernel's call on each of them
(interleaved rounds, CUDA events): times that alternate with the step say the data decides, equal ones that the
step's circumstances do (buffer addresses, printed per step, or the GPU's state).
Run on a GPU from the repository root: ``python notes/probe_step_kernels.py [480p|720p] [openvc,fa4]``
(``EXTRA=1`` in ``notes/device_run.sh`` for FA4).
"""

import collections
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import openvc_kernels
from openvc_diffusers.backends import kernel_options
from openvc_diffusers.config import load_config
from openvc_diffusers.gpu_state import clocks
from openvc_kernels import prep_ops
from probe_rope import load_bench_pipeline

STEPS = 6
ROWS = 14
NAME_CHARS = 48
REPLAY_ROUNDS = 5
REPLAY_CALLS = 10
MIB2 = 2 << 20


class FirstCallInputs:
    """Wraps ``prep_ops.prepare``: the first call's q, k, v after each ``next_step`` (cloned) and the addresses of
    that call's inputs and outputs, modulo 2 MiB (the GPU's large page)."""

    def __init__(self):
        self.inputs, self.addresses, self._want = [], [], False
        self._prepare = prep_ops.prepare
        prep_ops.prepare = self

    def next_step(self) -> None:
        self._want = True

    def __call__(self, q, k, v, *args, **kwargs):
        out = self._prepare(q, k, v, *args, **kwargs)
        if self._want:
            self._want = False
            self.inputs.append(tuple(x.clone() for x in (q, k, v)))
            named = {"q": q, "k": k, "v": v, "q8": out.q8, "k8": out.k8, "v_packed": out.v_packed}
            self.addresses.append({name: x.data_ptr() % MIB2 for name, x in named.items()})
        return out


def step_table(kernels: list, steps: int, step_ms: list[float]) -> None:
    kernels = sorted(kernels, key=lambda e: e.time_range.start)
    per_step, rest = divmod(len(kernels), steps)
    print(f"{len(kernels)} kernels, {per_step} a step{'' if rest == 0 else f', {rest} left over (cut is rough)'}")
    chunks = [kernels[i * per_step : (i + 1) * per_step] for i in range(steps)]
    boundaries = [chunks[i + 1][0].time_range.start - chunks[i][-1].time_range.end for i in range(steps - 1)]
    print("gaps at the cuts (us): " + " ".join(f"{gap:.0f}" for gap in boundaries))
    totals = collections.Counter()
    per_name = [collections.Counter() for _ in chunks]
    for counter, chunk in zip(per_name, chunks):
        for e in chunk:
            counter[e.name[:NAME_CHARS]] += e.time_range.elapsed_us() / 1e3
        totals.update(counter)
    header = " | ".join(f"{f'step {i + 1}':>8}" for i in range(steps))
    print(f"  {'kernel':{NAME_CHARS}} | {header} | odd/even")
    for name, _ in totals.most_common(ROWS):
        row_ms = [counter[name] for counter in per_name]
        print(f"  {name:{NAME_CHARS}} | " + " | ".join(f"{ms:8.2f}" for ms in row_ms) + f" | {odd_even(row_ms):+.1%}")
    busy = [sum(counter.values()) for counter in per_name]
    span = [(c[-1].time_range.end - c[0].time_range.start) / 1e3 for c in chunks]
    for label, row_ms in (("all kernels", busy), ("span", span), ("idle", [s - b for s, b in zip(span, busy)]),
                          ("step (events)", step_ms)):
        print(f"  {label:{NAME_CHARS}} | " + " | ".join(f"{ms:8.2f}" for ms in row_ms) + f" | {odd_even(row_ms):+.1%}")


def odd_even(values: list[float]) -> float:
    """The median of the even-numbered steps (2, 4, ...) over that of the odd-numbered ones, less 1."""
    return statistics.median(values[1::2]) / statistics.median(values[0::2]) - 1


def replay(inputs: list[tuple], options: dict) -> None:
    """The kernel's call on each step's saved inputs, interleaved rounds: median ms per step's inputs."""
    times = [[] for _ in inputs]
    for _ in range(REPLAY_ROUNDS):
        for i, (q, k, v) in enumerate(inputs):
            openvc_kernels.attention(q, k, v, **options)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(REPLAY_CALLS):
                openvc_kernels.attention(q, k, v, **options)
            end.record()
            end.synchronize()
            times[i].append(start.elapsed_time(end) / REPLAY_CALLS)
    medians = [statistics.median(t) for t in times]
    print("replay of each step's first self-attention inputs, ms a call: "
          + " ".join(f"{ms:.3f}" for ms in medians) + f" (even over odd {odd_even(medians):+.1%})")


def profile_backend(bench, model, timers, name: str, size: str) -> None:
    timer = timers[name]
    model.set_attn_processor(timer)
    bench.own_routes(model, timer)
    noise, texts = bench.make_inputs(model, bench.SIZES[size], cfg=False, seed=0, device="cuda")
    sigmas = torch.linspace(1, 0, STEPS + 1, device="cuda")
    watcher = FirstCallInputs() if name == "openvc" else None
    with torch.no_grad():
        bench.denoise(model, timer, noise, texts, sigmas[:2], "warm-up")
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        print(f"== {name}, {size}; clocks before: {clocks()}", flush=True)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            latents, step_ms = noise, []
            for i in range(STEPS):
                if watcher is not None:
                    watcher.next_step()
                latents, steps = bench.denoise(model, timer, latents, texts, sigmas[i : i + 2], f"step {i + 1}")
                step_ms.append(steps[0]["ms"])
                print(f"    latents at {latents.data_ptr() % MIB2:#x} (mod 2 MiB)", flush=True)
    print(f"clocks after: {clocks()}")
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    step_table(kernels, STEPS, step_ms)
    if watcher is not None:
        prep_ops.prepare = watcher._prepare
        for i, addresses in enumerate(watcher.addresses):
            print(f"  step {i + 1} first call, addresses mod 2 MiB: "
                  + " ".join(f"{key} {ptr:#x}" for key, ptr in addresses.items()))
        replay(watcher.inputs, kernel_options(load_config(bench.CONFIGS["openvc"])))


def main(argv: list[str]) -> None:
    bench = load_bench_pipeline()
    size = argv[0] if argv else "480p"
    names = (argv[1] if len(argv) > 1 else "openvc,fa4").split(",")
    model = bench.build_model(bench.parse_args([]), "cuda")  # the bench's transformer, seed 0
    timers = bench.install_backends(model, names)
    for name in names:
        profile_backend(bench, model, timers, name, size)


if __name__ == "__main__":
    main(sys.argv[1:])
