"""Device probe: where an eager Wan denoising forward's GPU time goes, kernel by kernel (torch.profiler), and how
long the GPU waits between kernels: the Wan2.1-1.3B-shaped transformer of ``examples/bench_pipeline.py`` (30
layers, random weights, bf16, one text of 512 tokens) at 480p (32,760 tokens) or 720p, with the self-attention
backend of one of the bench's runs (``openvc``: Open-VC's processor and defaults; ``fa4``: FA4 BF16 through the
same processor; both by default, in turn on the same model), after one warm-up forward.

Prints per kernel name (the first NAME_CHARS characters) its calls and GPU milliseconds per forward, the largest
first, and the total; then the forwards' span on the GPU (first kernel's start to last kernel's end), the time no
kernel ran in it, the largest gaps with the kernels on either side, the gaps' total per such pair, and how many
synchronizing CUDA calls one forward makes (``torch.cuda.set_sync_debug_mode``). ``fa4`` needs flash-attn-4
(``EXTRA=1`` in ``notes/device_run.sh``). The attention calls' kernels are among them (Open-VC's
preparation and forward kernels, cross-attention's SDPA), the rest is what every backend's step pays. Run on a GPU
from the repository root: ``python notes/profile_step.py [480p|720p] [openvc,fa4]``.
"""

import collections
import sys
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

import openvc_diffusers
from openvc_diffusers.gpu_state import clocks
from probe_rope import load_bench_pipeline

FORWARDS = 2
NAME_CHARS = 90
ROWS = 32
GAPS = 8
PAIRS = 24
GAP_NAME_CHARS = 60


def kernel_table(kernels: list, forwards: int) -> None:
    per_kernel = collections.defaultdict(lambda: [0, 0.0])
    for event in kernels:
        entry = per_kernel[event.name[:NAME_CHARS]]
        entry[0] += 1
        entry[1] += event.time_range.elapsed_us() / 1e3
    total = sum(ms for _, ms in per_kernel.values()) / forwards
    print(f"{total:.1f} ms of GPU time per forward")
    print(f"  {'calls':>6} | {'ms':>8} | {'share':>6} | kernel")
    ranked = sorted(per_kernel.items(), key=lambda item: -item[1][1])
    for name, (calls, ms) in ranked[:ROWS]:
        print(f"  {calls // forwards:6d} | {ms / forwards:8.2f} | {ms / forwards / total:6.1%} | {name}")
    if len(ranked) > ROWS:
        rest = sum(ms for _, (_, ms) in ranked[ROWS:]) / forwards
        print(f"  {'':6} | {rest:8.2f} | {rest / total:6.1%} | the other {len(ranked) - ROWS} kernels")


def idle_table(kernels: list, forwards: int) -> None:
    """The span of ``kernels`` on the GPU, the time in it that no kernel covers, the largest such gaps, and the
    gaps' total per pair of kernels on either side."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name[:GAP_NAME_CHARS]) for e in kernels)
    gaps, covered_to, before = [], spans[0][1], spans[0][2]
    for start, end, name in spans[1:]:
        if start > covered_to:
            gaps.append((start - covered_to, before, name))
        if end >= covered_to:
            covered_to, before = end, name
    span_ms = (covered_to - spans[0][0]) / 1e3
    idle_ms = sum(gap for gap, _, _ in gaps) / 1e3
    print(f"GPU span {span_ms / forwards:.1f} ms per forward, idle {idle_ms / forwards:.2f} ms in {len(gaps)} gaps")
    for gap, before, after in sorted(gaps, reverse=True)[:GAPS]:
        print(f"  {gap / 1e3:8.3f} ms between {before} and {after}")
    per_pair = collections.defaultdict(lambda: [0, 0.0])
    for gap, before, after in gaps:
        entry = per_pair[before, after]
        entry[0] += 1
        entry[1] += gap / 1e3
    print(f"  {'gaps':>6} | {'ms':>7} | {'us each':>7} | before -> after (per forward)")
    for (before, after), (count, ms) in sorted(per_pair.items(), key=lambda item: -item[1][1])[:PAIRS]:
        print(f"  {count // forwards:6d} | {ms / forwards:7.3f} | {ms / count * 1e3:7.2f} | {before} -> {after}")


def syncs_per_forward(forward) -> collections.Counter:
    """The synchronizing CUDA calls one ``forward()`` makes, by warning text and the Python line that made each."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            forward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return collections.Counter(f"{str(w.message)[:100]} at {w.filename}:{w.lineno}" for w in caught)


def profile_backend(bench, model, size: str, backend: str) -> None:
    model.set_attn_processor(bench.WanAttnProcessor())  # apply() takes diffusers' processors, not another run's
    processor = openvc_diffusers.apply(model, bench.CONFIGS[backend])
    noise, texts = bench.make_inputs(model, bench.SIZES[size], cfg=False, seed=0, device="cuda")
    sigma = torch.tensor(0.9, device="cuda")
    forward = lambda: bench.velocity(model, noise, texts, sigma)  # noqa: E731
    with torch.no_grad():
        forward()
        torch.cuda.synchronize()
        syncs = syncs_per_forward(forward)
        torch.cuda.synchronize()
        print(f"clocks before: {clocks()}")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(FORWARDS):
                forward()
            torch.cuda.synchronize()
        print(f"clocks after: {clocks()}")
    print(f"== {size}, {bench.tokens(model, bench.SIZES[size])} tokens, {backend}, calls {dict(processor.calls)}")
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernel_table(kernels, FORWARDS)
    idle_table(kernels, FORWARDS)
    print(f"synchronizing CUDA calls in one forward: {sum(syncs.values())}")
    for message, count in syncs.most_common():
        print(f"  {count:5d} x {message}")


def main(argv: list[str]) -> None:
    bench = load_bench_pipeline()
    size = argv[0] if argv else "480p"
    backends = (argv[1] if len(argv) > 1 else "openvc,fa4").split(",")
    model = bench.build_model(bench.parse_args([]), "cuda")  # the bench's transformer, seed 0
    for backend in backends:
        profile_backend(bench, model, size, backend)


if __name__ == "__main__":
    main(sys.argv[1:])
