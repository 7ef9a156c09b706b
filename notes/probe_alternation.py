"""Device probe: why a 480p eager step's time alternates in ``examples/bench_pipeline.py`` (2026-12-04: every
backend, 4-8% between odd and even steps, not in phase across backends; not at 720p).

For Open-VC and FA4 in turn, on the bench's model (Wan2.1-1.3B-shaped, random weights, bf16) at 480p, eager: STEPS
Euler steps as the bench takes them, then STEPS forwards on the same input (the same work every time), each timed
with CUDA events after a synchronize, with the SM clock and power just after it and the latents' address (the caching
allocator's buffer). Alternation on the fixed input too says it is not the data; alternation that follows the clock
says it is the power control. Run on a GPU from the repository root: ``python notes/probe_alternation.py``
(``EXTRA=1`` in ``notes/device_run.sh`` for FA4).
"""

import torch

from openvc_diffusers.gpu_state import clocks
from probe_rope import load_bench_pipeline

STEPS = 8


def timed(fn) -> tuple[float, torch.Tensor]:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end), out


def main() -> None:
    bench = load_bench_pipeline()
    model = bench.build_model(bench.parse_args([]), "cuda")  # the bench's transformer, seed 0
    timers = bench.install_backends(model, ["openvc", "fa4"])
    noise, texts = bench.make_inputs(model, bench.SIZES["480p"], cfg=False, seed=0, device="cuda")
    sigmas = torch.linspace(1, 0, STEPS + 1, device="cuda")
    for name, timer in timers.items():
        model.set_attn_processor(timer)
        bench.own_routes(model, timer)
        with torch.no_grad():
            bench.velocity(model, noise, texts, sigmas[0])  # warm-up: kernels compile here
            latents = noise
            for i in range(STEPS):
                step = sigmas[i + 1] - sigmas[i]
                ms, latents = timed(lambda: latents + step * bench.velocity(model, latents, texts, sigmas[i]))
                print(f"{name} euler {i}: {ms:7.1f} ms, latents at {latents.data_ptr():#x}, {clocks()}", flush=True)
            for i in range(STEPS):
                ms, _ = timed(lambda: bench.velocity(model, noise, texts, sigmas[0]))
                print(f"{name} fixed {i}: {ms:7.1f} ms, {clocks()}", flush=True)


if __name__ == "__main__":
    main()
