"""Device probe: where an eager Wan denoising forward's GPU time goes, kernel by kernel (torch.profiler), with
Open-VC's processor and its defaults: the Wan2.1-1.3B-shaped transformer of ``examples/bench_pipeline.py`` (30
layers, random weights, bf16, one text of 512 tokens) at 480p (32,760 tokens), after one warm-up forward.

Prints per kernel name (the first NAME_CHARS characters) its calls and GPU milliseconds per forward, the largest
first, and the total; the attention calls' kernels are among them (Open-VC's preparation and forward kernels,
cross-attention's SDPA), the rest is what every backend's step pays. Run on a GPU from the repository root:
``python notes/profile_step.py [480p|720p]``.
"""

import collections
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import openvc_diffusers
from openvc_diffusers.gpu_state import clocks
from probe_rope import load_bench_pipeline

FORWARDS = 2
NAME_CHARS = 90
ROWS = 32


def main(argv: list[str]) -> None:
    bench = load_bench_pipeline()
    size = argv[0] if argv else "480p"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = bench.WanTransformer3DModel(**bench.WAN_1_3B)
    model = bench.cast_like_from_pretrained(model, torch.bfloat16).eval()
    openvc_diffusers.apply(model)
    noise, texts = bench.make_inputs(model, bench.SIZES[size], cfg=False, seed=0, device="cuda")
    sigma = torch.tensor(0.9, device="cuda")
    with torch.no_grad():
        bench.velocity(model, noise, texts, sigma)
        torch.cuda.synchronize()
        print(f"clocks before: {clocks()}")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(FORWARDS):
                bench.velocity(model, noise, texts, sigma)
            torch.cuda.synchronize()
        print(f"clocks after: {clocks()}")
    per_kernel = collections.defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = per_kernel[event.name[:NAME_CHARS]]
            entry[0] += 1
            entry[1] += event.time_range.elapsed_us() / 1e3
    total = sum(ms for _, ms in per_kernel.values()) / FORWARDS
    print(f"{size}, {bench.tokens(model, bench.SIZES[size])} tokens: {total:.1f} ms of GPU time per forward")
    print(f"  {'calls':>6} | {'ms':>8} | {'share':>6} | kernel")
    ranked = sorted(per_kernel.items(), key=lambda item: -item[1][1])
    for name, (calls, ms) in ranked[:ROWS]:
        print(f"  {calls // FORWARDS:6d} | {ms / FORWARDS:8.2f} | {ms / FORWARDS / total:6.1%} | {name}")
    rest = sum(ms for _, (_, ms) in ranked[ROWS:]) / FORWARDS
    print(f"  {'':6} | {rest:8.2f} | {rest / total:6.1%} | the other {len(ranked) - ROWS} kernels")


if __name__ == "__main__":
    main(sys.argv[1:])
