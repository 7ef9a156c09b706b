"""End-to-end denoising speed of a Wan2.1-T2V-1.3B-shaped transformer with FA4 BF16, cuDNN BF16 and Open-VC
attention, eager and compiled with torch.compile; prints a table.

    python examples/bench_pipeline.py                          # 480p and 720p, 3 timed steps, all 30 layers, eager
    python examples/bench_pipeline.py --compile both           # the same eager, then compiled
    python examples/bench_pipeline.py --size 480p --steps 5 --cfg --json out.json
    python examples/bench_pipeline.py --single-block-14b --size 720p
    python examples/bench_pipeline.py --tiny                   # tiny random Wan on the CPU (default without CUDA)

The transformer is WanTransformer3DModel with Wan2.1-T2V-1.3B's configuration (--single-block-14b: one block of
Wan 14B's, 40 heads, dim 5120, ffn 13824) and seeded random weights, in bfloat16 with the modules diffusers keeps
in float32 as from_pretrained loads it. There is no text encoder and no VAE: random 512 x 4096 text embeddings
go in as encoder_hidden_states, and the latents are those of 81 frames: 21 x 60 x 104 at 480p (32,760 tokens),
21 x 90 x 160 at 720p (75,600 tokens).

A denoising step is one transformer forward (two with --cfg, conditional and unconditional, as WanPipeline runs
them) and a flow-matching Euler update, over sigmas linspace(1, 0, steps + 1). The modes run in turn (eager first
with --compile both), and in each, per size, in a random order, each backend starts from the same noise after one
untimed warm-up step:
  fa4     self-attention on FlashAttention-4 BF16 (the flash-attn-4 package; reported unavailable without it)
  sdpa    diffusers' stock attention, torch SDPA held to cuDNN by sdpa_kernel(CUDNN_ATTENTION)
  openvc  Open-VC FP8, openvc_diffusers.apply(model, {"min_tokens": 0})
All three run through the same processor (Open-VC's mirror of diffusers' Wan processor, bit-identical to it with
backends [sdpa]), with CUDA events around each attention call in eager runs; cross-attention (512 text keys) takes
SDPA in every run, under cuDNN only in the sdpa run.

--compile blocks (or both) compiles the transformer the way diffusers users do,
model.compile_repeated_blocks(fullgraph=True) with inductor: one compiled block for all blocks. Every compiled run
(one backend at one size) starts from torch._dynamo.reset() and compiles afresh, so no run reuses code traced
through another backend; its warm-up step includes the compilation (warm_up_s in the JSON), and a graph that
dynamo compiles during the timed steps is reported as a recompile (RECOMPILED in the table) rather than timed
silently. Where dynamo cannot trace a block whole (as may be so of FA4: flash-attn-4 runs its CuTe kernels from
Python, through no custom op), fullgraph fails and the run compiles again with fullgraph=False: its graph breaks
are counted and reported. The timer's events would break the graph, so compiled runs time whole steps only: their
attention shares are "-".

Per backend and mode: seconds per step (``seconds_per_step``: the mean of the odd and the even timed steps'
medians, CUDA events), the share of step time spent in
attention calls (Open-VC's quantization included; eager only), peak memory over the timed steps (torch.cuda
.max_memory_allocated, weights included), speedup over FA4 and over SDPA in the same mode, the backends that took
the calls (a fallback is flagged), and PSNR against the sdpa run of the same mode: on the final latents, and on
frames decoded from the first --decode-frames latent frames by a Wan 2.1 VAE (AutoencoderKLWan's default
configuration, seeded random weights, float32; nothing is downloaded), with SSIM on those frames. Peaks are the
sdpa run's range (max - min). With --compile both, compiled rows also give the PSNR of their final latents against
the same backend's eager run.
Random weights give near-uniform attention, so these figures check that nothing is broken; they do not measure
quality on real video (examples/generate.py does, with real weights).

--tiny runs the same code on openvc_diffusers.tiny's transformer and latent size, float32 on the CPU, with
sdpa and openvc (its PyTorch reference) only: a smoke test of the script, not a benchmark; --compile works there
too (inductor builds C++ for the CPU).
"""

import argparse
import itertools
import json
import math
import random
import statistics
import time
import traceback
from contextlib import nullcontext

import torch
from diffusers import AutoencoderKLWan, WanTransformer3DModel
from diffusers.models.transformers.transformer_wan import WanAttnProcessor
from torch._dynamo.exc import Unsupported
from torch._dynamo.utils import counters as dynamo_counters
from torch.nn.attention import SDPBackend, sdpa_kernel

from openvc_diffusers import cli
from openvc_diffusers.backends import fa4_installed
from openvc_diffusers.gpu_state import clocks
from openvc_diffusers.metrics import psnr, ssim
from openvc_diffusers.pipelines import install
from openvc_diffusers.config import FA4, SDPA
from openvc_diffusers.policy import OPENVC_KERNEL, OPENVC_REFERENCE
from openvc_diffusers.tiny import cast_like_from_pretrained, tiny_wan_inputs, tiny_wan_transformer, tiny_wan_vae

WAN_1_3B = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=12,
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    ffn_dim=8960,
    num_layers=30,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    rope_max_seq_len=1024,
)
WAN_14B_BLOCK = {**WAN_1_3B, "num_attention_heads": 40, "ffn_dim": 13824, "num_layers": 1}
SIZES = {"480p": (21, 60, 104), "720p": (21, 90, 160)}
"""Latent frames x height x width of 81-frame videos (Wan's VAE: 4x temporal, 8x spatial compression)."""
TEXT_TOKENS = 512
GUIDANCE_SCALE = 5.0

CONFIGS = {
    # openvc left out of the chain, so FA4 takes every self-attention call it can (calls shows any it cannot).
    "fa4": {"backends": ["fa4", "sdpa"]},
    "sdpa": {"backends": ["sdpa"]},
    "openvc": {"min_tokens": 0},
}
EXPECTED = {"fa4": {FA4}, "sdpa": {SDPA}, "openvc": {OPENVC_KERNEL, OPENVC_REFERENCE}}
"""The backends each run's self-attention should take; anything else is a fallback."""
MODES = {"none": ("eager",), "blocks": ("compiled",), "both": ("eager", "compiled")}
"""--compile's choices and the modes each runs, in order."""


def log(message: str) -> None:
    print(message, flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--size", type=cli.names_from(SIZES, "size"), help="comma-separated, from 480p and 720p (default: both)"
    )
    parser.add_argument(
        "--steps", type=cli.positive_int, default=3, help="timed denoising steps (default: %(default)s)"
    )
    parser.add_argument("--cfg", action="store_true", help="classifier-free guidance: two forwards per step")
    parser.add_argument(
        "--decode-frames",
        type=cli.nonnegative_int,
        default=2,
        help="latent frames to decode for the frame PSNR, 0 for none, at most the run's latent frames (21, 2 with "
        "--tiny) (default: %(default)s, 5 video frames)",
    )
    parser.add_argument(
        "--layers", type=cli.positive_int, help="transformer blocks (default: 30, or 1 with --single-block-14b)"
    )
    parser.add_argument(
        "--single-block-14b",
        action="store_true",
        help="Wan 14B's block shape (40 heads x 128, dim 5120, ffn 13824), for when the full model takes too long",
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        default=None,
        help="the tiny random Wan, float32 on the CPU, sdpa and openvc only (default where there is no CUDA)",
    )
    parser.add_argument(
        "--json",
        type=cli.writable_file,
        default="bench_pipeline.json",
        help="where to write the results (default: %(default)s)",
    )
    parser.add_argument(
        "--compile",
        choices=MODES,
        default="none",
        help="none: eager; blocks: the transformer's blocks compiled (compile_repeated_blocks(fullgraph=True), "
        "inductor); both: eager, then compiled (default: %(default)s)",
    )
    # Tests compile with aot_eager: inductor's C++ build on a 2-core CPU takes longer than a test should.
    parser.add_argument("--compile-backend", default="inductor", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=cli.seed, default=0, help="weights, inputs and backend order (default: 0)")
    args = parser.parse_args(argv)
    full_size_options = args.size or args.layers or args.single_block_14b
    if args.tiny and full_size_options:
        parser.error("--tiny has its own size and layers: --size, --layers and --single-block-14b do not apply")
    if args.tiny is None:
        args.tiny = not (torch.cuda.is_available() or full_size_options)
    if not args.tiny and not torch.cuda.is_available():
        parser.error("the full-size benchmark needs a CUDA GPU; --tiny runs on the CPU")
    latent_frames = min(latent[0] for latent in latent_sizes(args).values())
    if args.decode_frames > latent_frames:
        video = "tiny model's" if args.tiny else "81-frame"
        parser.error(
            f"argument --decode-frames: {args.decode_frames} is more than the {latent_frames} latent frames of the "
            f"{video} video"
        )
    return args


def build_model(args: argparse.Namespace, device: str) -> WanTransformer3DModel:
    if args.tiny:
        return tiny_wan_transformer(seed=args.seed)
    config = WAN_14B_BLOCK if args.single_block_14b else WAN_1_3B
    if args.layers:
        config = {**config, "num_layers": args.layers}
    torch.manual_seed(args.seed)
    with torch.device(device):  # initialised on the GPU: seconds rather than a minute on the CPU
        model = WanTransformer3DModel(**config)
    return cast_like_from_pretrained(model, torch.bfloat16).eval()


def build_vae(args: argparse.Namespace, device: str) -> AutoencoderKLWan:
    if args.tiny:
        return tiny_wan_vae(seed=args.seed)
    torch.manual_seed(args.seed)
    with torch.device(device):
        return AutoencoderKLWan().eval()


def decode(vae: AutoencoderKLWan, latents: torch.Tensor, frames: int) -> torch.Tensor:
    """The first ``frames`` latent frames as video frames ``(T, H, W, 3)``, float32, as WanPipeline decodes
    them (latents scaled by the VAE's statistics)."""
    z = latents[:, :, :frames].to(vae.dtype)
    mean, std = (torch.tensor(vae.config[key]).view(1, -1, 1, 1, 1).to(z) for key in ("latents_mean", "latents_std"))
    with torch.no_grad():
        video = vae.decode(z * std + mean, return_dict=False)[0]  # (1, 3, T, H, W)
    return video[0].permute(1, 2, 3, 0).float()


def tokens(model: WanTransformer3DModel, latent: tuple[int, int, int]) -> int:
    return math.prod(n // p for n, p in zip(latent, model.config.patch_size))


def latent_sizes(args: argparse.Namespace) -> dict[str, tuple[int, int, int]]:
    if args.tiny:
        return {"tiny": tuple(tiny_wan_inputs()["hidden_states"].shape[2:])}
    return {size: SIZES[size] for size in args.size or SIZES}


def make_inputs(model, latent, cfg: bool, seed: int, device: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Float32 noise and one random text embedding per forward of a step (conditional, then unconditional)."""
    g = torch.Generator().manual_seed(seed)  # on the CPU: the same inputs on every device
    noise = torch.randn(1, model.config.in_channels, *latent, generator=g)
    texts = [torch.randn(1, TEXT_TOKENS, model.config.text_dim, generator=g) for _ in range(2 if cfg else 1)]
    return noise.to(device), [t.to(device, model.dtype) for t in texts]


class AttentionTimer:
    """Mixin for the family processor (``pipelines.install``): marks the start and end of every attention call on
    the device's timeline, without synchronising, so the timing does not change what it times."""

    def __init__(self, config=None):
        super().__init__(config)
        self.spans = []
        """(kind, start, end) of the calls since the last clear."""

    def _attend(self, attn, q, k, v, *, is_cross, **kwargs):
        if torch.compiler.is_compiling():  # events and clocks would break the graph: compiled runs time steps only
            return super()._attend(attn, q, k, v, is_cross=is_cross, **kwargs)
        start = mark(q.device)
        out = super()._attend(attn, q, k, v, is_cross=is_cross, **kwargs)
        self.spans.append(("cross" if is_cross else "self", start, mark(q.device)))
        return out


def mark(device: torch.device):
    """A point in time on ``device``'s timeline: a recorded CUDA event, or perf_counter on the CPU."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def elapsed_ms(start, end) -> float:
    return (end - start) * 1e3 if isinstance(start, float) else start.elapsed_time(end)


def velocity(model, latents: torch.Tensor, texts: list[torch.Tensor], sigma: torch.Tensor) -> torch.Tensor:
    """The flow prediction at ``sigma``, with guidance when there are two texts; float32."""
    timestep = (sigma * 1000).reshape(1)
    x = latents.to(model.dtype)
    preds = [model(hidden_states=x, timestep=timestep, encoder_hidden_states=t, return_dict=False)[0] for t in texts]
    if len(preds) == 2:
        cond, uncond = preds
        preds = [uncond + GUIDANCE_SCALE * (cond - uncond)]
    return preds[0].float()


def denoise(
    model, timer: AttentionTimer, noise, texts, sigmas, label: str, *, time_attention: bool = True
) -> tuple[torch.Tensor, list[dict]]:
    """Euler steps from ``noise`` over ``sigmas``: the final latents and, per step, its time and (with
    ``time_attention``) its attention calls' time in ms, else None."""
    latents, steps = noise, []
    for i, (sigma, sigma_next) in enumerate(itertools.pairwise(sigmas)):
        timer.spans.clear()
        start = mark(noise.device)
        latents = latents + (sigma_next - sigma) * velocity(model, latents, texts, sigma)
        end = mark(noise.device)
        if noise.device.type == "cuda":
            end.synchronize()
        step = {"ms": elapsed_ms(start, end), "self_ms": None, "cross_ms": None}
        if time_attention:
            step.update(self_ms=0.0, cross_ms=0.0)
            for kind, call_start, call_end in timer.spans:
                step[f"{kind}_ms"] += elapsed_ms(call_start, call_end)
        steps.append(step)
        share = attention_share([step], ("self_ms", "cross_ms"))
        attention = "" if share is None else f", attention {share:.0%}"
        log(f"    {label} {i + 1}/{len(sigmas) - 1}: {step['ms'] / 1e3:.3f} s{attention}")
    return latents, steps


def seconds_per_step(step_ms: list[float]) -> float:
    """The mean of the median of the odd-numbered steps' times and that of the even-numbered ones, in seconds (one
    step: its time). On the H200 a step's time alternated between two values, 4-8% apart, in every eager run of
    2026-12-04, the backends not in phase, so that the plain median of an odd number of steps took one backend's
    fast steps and another's slow ones."""
    halves = [step_ms[0::2], step_ms[1::2]]
    return statistics.mean(statistics.median(half) for half in halves if half) / 1e3


def attention_share(steps: list[dict], kinds: tuple[str, ...]) -> float | None:
    """The share of the steps' time in the calls of ``kinds`` ("self_ms", "cross_ms"); None where untimed."""
    if steps[0][kinds[0]] is None:
        return None
    return sum(s[kind] for s in steps for kind in kinds) / sum(s["ms"] for s in steps)


def install_backends(model, names: list[str]) -> dict[str, AttentionTimer]:
    """One timed processor per backend, installed once (each install adds a step-tracking hook); runs switch
    between them with set_attn_processor."""
    processors = {}
    for name in names:
        model.set_attn_processor(WanAttnProcessor())  # apply() takes diffusers' processors, not another run's
        processors[name] = install(model, AttentionTimer, CONFIGS[name])
    return processors


def run_backend(
    model, name: str, timer: AttentionTimer, noise, texts, sigmas, compile_backend: str | None
) -> tuple[dict, torch.Tensor]:
    """One backend's warm-up and timed steps, eager or (``compile_backend`` given) compiled: its result row and
    final latents."""
    device = noise.device
    model.set_attn_processor(timer)
    own_routes(model, timer)
    cudnn = device.type == "cuda" and name == "sdpa"
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION) if cudnn else nullcontext(), torch.no_grad():
        # Compilation, autotuning and the allocator's first growth land here, not in the timed steps.
        warm_up_start = time.perf_counter()
        if compile_backend is None:
            compiled = None
            denoise(model, timer, noise, texts, sigmas[:2], "warm-up")
        else:
            compiled = compile_and_warm_up(model, name, timer, noise, texts, sigmas, compile_backend)
        warm_up_s = time.perf_counter() - warm_up_start
        graphs_before = compiled_graphs()
        timer.calls.clear()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        latents, steps = denoise(model, timer, noise, texts, sigmas, "step", time_attention=compiled is None)
    row = {
        "available": True,
        "s_per_step": seconds_per_step([s["ms"] for s in steps]),
        "steps": steps,
        "warm_up_s": warm_up_s,
        "attention_share": attention_share(steps, ("self_ms", "cross_ms")),
        "self_attention_share": attention_share(steps, ("self_ms",)),
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
        "calls": {f"{kind}:{backend}": n for (kind, backend), n in sorted(timer.calls.items())},
        "compile": compiled,
    }
    if compiled is not None:
        compiled["recompiles"] = compiled_graphs() - graphs_before
        if compiled["recompiles"]:
            log(f"    WARNING: {name}: {compiled['recompiles']} graphs compiled during the timed steps")
    taken = {backend for kind, backend in timer.calls if kind == "self"}
    if not taken <= EXPECTED[name]:
        row["fallback"] = f"self-attention went to {', '.join(sorted(taken))}, not only {', '.join(EXPECTED[name])}"
        log(f"    WARNING: {name}: {row['fallback']} (reasons are logged above)")
    return row, latents


def own_routes(model, processor: AttentionTimer) -> None:
    """Give ``processor`` a route on every attention module before any call, numbered in module order as apply
    numbers them. Otherwise the compiled warm-up makes them, and the code traced then, guarded on the modules' old
    routes (none, or the last run's processor's), is compiled again in the first timed step."""
    processor.layer_count = 0
    for block in model.blocks:
        processor.route(block.attn1, is_cross=False)
        processor.route(block.attn2, is_cross=True)


def compile_and_warm_up(model, name: str, timer: AttentionTimer, noise, texts, sigmas, backend: str) -> dict:
    """Compile the model's blocks afresh for this run and run the warm-up step, which compiles them, with
    fullgraph=True, or where dynamo cannot trace a block whole (an attention call it cannot trace), again with
    graph breaks; how it compiled, for the row."""
    breaks_before = graph_breaks()
    try:
        compile_blocks(model, backend, fullgraph=True)
        denoise(model, timer, noise, texts, sigmas[:2], "warm-up, compiling", time_attention=False)
        fullgraph = True
    except Unsupported as e:
        log(f"    {name}: no full graph ({str(e).splitlines()[0]}); compiling with graph breaks")
        compile_blocks(model, backend, fullgraph=False)
        denoise(model, timer, noise, texts, sigmas[:2], "warm-up, compiling", time_attention=False)
        fullgraph = False
    return {"backend": backend, "fullgraph": fullgraph, "graph_breaks": graph_breaks() - breaks_before}


def compile_blocks(model, backend: str, fullgraph: bool) -> None:
    # Without the reset, dynamo would keep the code it traced through the previous run's processor and backend.
    torch._dynamo.reset()
    model.compile_repeated_blocks(fullgraph=fullgraph, backend=backend)


def compiled_graphs() -> int:
    """Graphs dynamo has compiled since the process began: once warm, each is a recompile."""
    return dynamo_counters["stats"]["unique_graphs"]


def graph_breaks() -> int:
    return sum(dynamo_counters["graph_break"].values())


def bench_size(
    model, vae, processors, size: str, latent, args, order: list[str], device: str, mode: str, eager: dict
) -> tuple[dict, dict[str, torch.Tensor]]:
    """One size in one mode: its row and each backend's final latents. ``eager``: the eager run's final latents
    at this size, to compare compiled runs with (empty where there is none)."""
    noise, texts = make_inputs(model, latent, args.cfg, args.seed, device)
    sigmas = torch.linspace(1, 0, args.steps + 1, device=device)
    compile_backend = args.compile_backend if mode == "compiled" else None
    row = {
        "size": size,
        "mode": mode,
        "latent": list(latent),
        "tokens": tokens(model, latent),
        "order": order,
        "backends": {},
    }
    log(f"{size}, {mode}: latents {'x'.join(map(str, latent))}, {row['tokens']} tokens, order {', '.join(order)}")
    latents = {}
    for name in order:
        log(f"  {name}")
        row["backends"][name], final = try_backend(model, name, processors, noise, texts, sigmas, compile_backend)
        result = row["backends"][name]
        if final is None:
            log(f"  {name}: unavailable ({result['reason']})")
            continue
        latents[name] = final
        log(f"  {name}: {result['s_per_step']:.3f} s/step, calls {result['calls']}")
    frames = {name: decode(vae, final, args.decode_frames) for name, final in latents.items()} if vae else {}
    compare(row["backends"], latents, frames, eager)
    return row, latents


def try_backend(
    model, name: str, processors, noise, texts, sigmas, compile_backend: str | None
) -> tuple[dict, torch.Tensor | None]:
    """``run_backend``, or a row that says why the backend did not run: one backend failing must not lose the
    others' numbers."""
    if name == "fa4" and not fa4_installed():
        return {"available": False, "reason": "flash-attn-4 is not installed"}, None
    try:
        return run_backend(model, name, processors[name], noise, texts, sigmas, compile_backend)
    except Exception as e:  # a kernel that does not build, out of memory
        traceback.print_exc()
        return {"available": False, "reason": f"{type(e).__name__}: {e}"}, None


def compare(
    results: dict[str, dict],
    latents: dict[str, torch.Tensor],
    frames: dict[str, torch.Tensor],
    eager: dict[str, torch.Tensor],
) -> None:
    """Speedups over FA4 and SDPA, PSNR (latents, decoded frames) and SSIM (frames) against SDPA's run, all in the
    same mode, and PSNR of the latents against the same backend's ``eager`` latents, into each available row."""
    for name, row in results.items():
        if not row["available"]:
            continue
        for base in ("fa4", "sdpa"):
            base_s = results[base]["s_per_step"] if results.get(base, {}).get("available") else None
            row[f"speedup_vs_{base}"] = base_s / row["s_per_step"] if base_s else None
        row["psnr_vs_sdpa_db"] = _against_sdpa(psnr, latents, name)
        row["frames_psnr_vs_sdpa_db"] = _against_sdpa(psnr, frames, name)
        row["frames_ssim_vs_sdpa"] = _against_sdpa(ssim, frames, name)
        row["psnr_vs_eager_db"] = _against(psnr, latents[name], eager.get(name))


def _against_sdpa(metric, outputs: dict[str, torch.Tensor], name: str) -> float | None:
    if name == "sdpa" or name not in outputs:
        return None
    return _against(metric, outputs[name], outputs.get("sdpa"))


def _against(metric, output: torch.Tensor, ref: torch.Tensor | None) -> float | None:
    if ref is None:
        return None
    return metric(output, ref, data_range=(ref.max() - ref.min()).item())


def table(rows: list[dict]) -> str:
    """One line per size, backend and mode: each backend's eager and compiled rows next to each other."""
    head = (
        f"{'size':>5} | {'mode':>8} | {'backend':>7} | {'s/step':>7} | {'attn %':>6} | {'self %':>6} | "
        f"{'peak GiB':>8} | {'x FA4':>5} | {'x SDPA':>6} | {'PSNR dB':>7} | {'frames':>6} | {'SSIM':>6} | "
        f"{'eager dB':>8} | self-attention calls"
    )
    lines = [head, "-" * len(head)]
    for size in dict.fromkeys(row["size"] for row in rows):
        same_size = [row for row in rows if row["size"] == size]
        for name in sorted(same_size[0]["backends"]):
            lines.extend(table_line(row, name) for row in same_size)
    return "\n".join(lines)


def table_line(row: dict, name: str) -> str:
    r = row["backends"][name]
    start = f"{row['size']:>5} | {row['mode']:>8} | {name:>7} | "
    if not r["available"]:
        return f"{start}unavailable: {r['reason']}"
    calls = ", ".join(f"{k.split(':')[1]} {n}" for k, n in r["calls"].items() if k.startswith("self:"))
    return (
        f"{start}{r['s_per_step']:7.3f} | {fmt(r['attention_share'], 6, '.0%')} | "
        f"{fmt(r['self_attention_share'], 6, '.0%')} | {fmt(r['peak_memory_gib'], 8, '.2f')} | "
        f"{fmt(r['speedup_vs_fa4'], 5, '.2f')} | {fmt(r['speedup_vs_sdpa'], 6, '.2f')} | "
        f"{fmt(r['psnr_vs_sdpa_db'], 7, '.2f')} | {fmt(r['frames_psnr_vs_sdpa_db'], 6, '.2f')} | "
        f"{fmt(r['frames_ssim_vs_sdpa'], 6, '.4f')} | {fmt(r['psnr_vs_eager_db'], 8, '.2f')} | {calls}{flags(r)}"
    )


def flags(result: dict) -> str:
    """What the table must not leave unsaid: a fallback, graphs compiled in the timed steps, graph breaks."""
    found = ["FALLBACK"] if "fallback" in result else []
    compiled = result["compile"]
    if compiled and compiled["recompiles"]:
        found.append(f"RECOMPILED {compiled['recompiles']}")
    if compiled and compiled["graph_breaks"]:
        found.append(f"graph breaks {compiled['graph_breaks']}")
    return "".join(f"  {flag}" for flag in found)


def fmt(value, width: int, spec: str) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:{width}{spec}}"


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = "cpu" if args.tiny else "cuda"
    rng = random.Random(args.seed)
    model = build_model(args, device)
    vae = build_vae(args, device) if args.decode_frames else None
    names = ["sdpa", "openvc"] if args.tiny else ["fa4", "sdpa", "openvc"]
    processors = install_backends(model, [n for n in names if n != "fa4" or fa4_installed()])
    meta = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "model": "tiny" if args.tiny else "Wan 14B single block" if args.single_block_14b else "Wan2.1-T2V-1.3B",
        "config": {key: model.config[key] for key in WAN_1_3B},
        "dtype": str(model.dtype).removeprefix("torch."),
        "steps": args.steps,
        "cfg": args.cfg,
        "modes": list(MODES[args.compile]),
        "compile": f"compile_repeated_blocks(fullgraph=True, backend={args.compile_backend!r})"
        if args.compile != "none"
        else None,
        "psnr_on": f"final latents, and {args.decode_frames} latent frames decoded by a random-weight Wan VAE; "
        "peaks = the sdpa run's range",
        "clocks_before": clocks() if device == "cuda" else None,
    }
    log(f"{meta['model']} ({meta['config']['num_layers']} layers, {meta['dtype']}) on {meta['device']}")
    if meta["clocks_before"]:
        log(f"clocks (sm, mem, temp, power) before: {meta['clocks_before']}")
    rows, eager_latents = [], {}
    # Modes outside sizes: the blocks, once compiled, stay compiled.
    for mode in MODES[args.compile]:
        for size, latent in latent_sizes(args).items():
            order = rng.sample(names, len(names))
            row, latents = bench_size(
                model, vae, processors, size, latent, args, order, device, mode, eager_latents.get(size, {})
            )
            rows.append(row)
            if mode == "eager":
                eager_latents[size] = latents
    meta["clocks_after"] = clocks() if device == "cuda" else None
    if meta["clocks_after"]:
        log(f"clocks after: {meta['clocks_after']}")
    results = {"meta": meta, "rows": rows}
    cli.create_parent(args.json)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)
    log(
        f"wrote {args.json}; PSNR: final latents, then decoded frames, against the sdpa run of the same mode; "
        "eager dB: final latents against the same backend's eager run"
    )
    log(table(rows))
    return results


if __name__ == "__main__":
    main()
