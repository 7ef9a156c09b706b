"""End-to-end denoising speed of a Wan2.1-T2V-1.3B-shaped transformer with FA4 BF16, cuDNN BF16 and Open-VC
attention; prints a table.

    python examples/bench_pipeline.py                          # 480p and 720p, 3 timed steps, all 30 layers
    python examples/bench_pipeline.py --size 480p --steps 5 --cfg --json out.json
    python examples/bench_pipeline.py --single-block-14b --size 720p
    python examples/bench_pipeline.py --tiny                   # tiny random Wan on the CPU (default without CUDA)

The transformer is WanTransformer3DModel with Wan2.1-T2V-1.3B's configuration (--single-block-14b: one block of
Wan 14B's, 40 heads, dim 5120, ffn 13824) and seeded random weights, in bfloat16 with the modules diffusers keeps
in float32 as from_pretrained loads it. There is no text encoder and no VAE: random 512 x 4096 text embeddings
go in as encoder_hidden_states, and the latents are those of 81 frames: 21 x 60 x 104 at 480p (32,760 tokens),
21 x 90 x 160 at 720p (75,600 tokens).

A denoising step is one transformer forward (two with --cfg, conditional and unconditional, as WanPipeline runs
them) and a flow-matching Euler update, over sigmas linspace(1, 0, steps + 1). Per size, in a random order, each
backend starts from the same noise after one untimed warm-up step:
  fa4     self-attention on FlashAttention-4 BF16 (the flash-attn-4 package; reported unavailable without it)
  sdpa    diffusers' stock attention, torch SDPA held to cuDNN by sdpa_kernel(CUDNN_ATTENTION)
  openvc  Open-VC FP8, openvc_diffusers.apply(model, {"min_tokens": 0})
All three run through the same processor (Open-VC's mirror of diffusers' Wan processor, bit-identical to it with
backends [sdpa]) with CUDA events around each attention call; cross-attention (512 text keys) takes SDPA in
every run, under cuDNN only in the sdpa run.

Per backend: seconds per step (median of the timed steps, CUDA events), the share of step time spent in
attention calls (Open-VC's quantization included), peak memory over the timed steps (torch.cuda
.max_memory_allocated, weights included), speedup over FA4 and over SDPA, the backends that took the calls (a
fallback is flagged), and PSNR against the sdpa run: on the final latents, and on frames decoded from the first
--decode-frames latent frames by a Wan 2.1 VAE (AutoencoderKLWan's default configuration, seeded random
weights, float32; nothing is downloaded), with SSIM on those frames. Peaks are the sdpa run's range (max - min).
Random weights give near-uniform attention, so these figures check that nothing is broken; they do not measure
quality on real video (examples/generate.py does, with real weights).

--tiny runs the same code on openvc_diffusers.tiny's transformer and latent size, float32 on the CPU, with
sdpa and openvc (its PyTorch reference) only: a smoke test of the script, not a benchmark.
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


def denoise(model, timer: AttentionTimer, noise, texts, sigmas, label: str) -> tuple[torch.Tensor, list[dict]]:
    """Euler steps from ``noise`` over ``sigmas``: the final latents and, per step, its time and its attention
    calls' time in ms."""
    latents, steps = noise, []
    for i, (sigma, sigma_next) in enumerate(itertools.pairwise(sigmas)):
        timer.spans.clear()
        start = mark(noise.device)
        latents = latents + (sigma_next - sigma) * velocity(model, latents, texts, sigma)
        end = mark(noise.device)
        if noise.device.type == "cuda":
            end.synchronize()
        step = {"ms": elapsed_ms(start, end), "self_ms": 0.0, "cross_ms": 0.0}
        for kind, call_start, call_end in timer.spans:
            step[f"{kind}_ms"] += elapsed_ms(call_start, call_end)
        steps.append(step)
        share = (step["self_ms"] + step["cross_ms"]) / step["ms"]
        log(f"    {label} {i + 1}/{len(sigmas) - 1}: {step['ms'] / 1e3:.3f} s, attention {share:.0%}")
    return latents, steps


def install_backends(model, names: list[str]) -> dict[str, AttentionTimer]:
    """One timed processor per backend, installed once (each install adds a step-tracking hook); runs switch
    between them with set_attn_processor."""
    processors = {}
    for name in names:
        model.set_attn_processor(WanAttnProcessor())  # apply() takes diffusers' processors, not another run's
        processors[name] = install(model, AttentionTimer, CONFIGS[name])
    return processors


def run_backend(model, name: str, timer: AttentionTimer, noise, texts, sigmas) -> tuple[dict, torch.Tensor]:
    """One backend's warm-up and timed steps: its result row and final latents."""
    device = noise.device
    model.set_attn_processor(timer)
    cudnn = device.type == "cuda" and name == "sdpa"
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION) if cudnn else nullcontext(), torch.no_grad():
        # Compilation, autotuning and the allocator's first growth land here, not in the timed steps.
        denoise(model, timer, noise, texts, sigmas[:2], "warm-up")
        timer.calls.clear()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        latents, steps = denoise(model, timer, noise, texts, sigmas, "step")
    total_ms = sum(s["ms"] for s in steps)
    row = {
        "available": True,
        "s_per_step": statistics.median(s["ms"] for s in steps) / 1e3,
        "steps": steps,
        "attention_share": sum(s["self_ms"] + s["cross_ms"] for s in steps) / total_ms,
        "self_attention_share": sum(s["self_ms"] for s in steps) / total_ms,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
        "calls": {f"{kind}:{backend}": n for (kind, backend), n in sorted(timer.calls.items())},
    }
    taken = {backend for kind, backend in timer.calls if kind == "self"}
    if not taken <= EXPECTED[name]:
        row["fallback"] = f"self-attention went to {', '.join(sorted(taken))}, not only {', '.join(EXPECTED[name])}"
        log(f"    WARNING: {name}: {row['fallback']} (reasons are logged above)")
    return row, latents


def bench_size(model, vae, processors, size: str, latent, args, order: list[str], device: str) -> dict:
    noise, texts = make_inputs(model, latent, args.cfg, args.seed, device)
    sigmas = torch.linspace(1, 0, args.steps + 1, device=device)
    row = {"size": size, "latent": list(latent), "tokens": tokens(model, latent), "order": order, "backends": {}}
    log(f"{size}: latents {'x'.join(map(str, latent))}, {row['tokens']} tokens, order {', '.join(order)}")
    latents = {}
    for name in order:
        log(f"  {name}")
        row["backends"][name], final = try_backend(model, name, processors, noise, texts, sigmas)
        result = row["backends"][name]
        if final is None:
            log(f"  {name}: unavailable ({result['reason']})")
            continue
        latents[name] = final
        log(f"  {name}: {result['s_per_step']:.3f} s/step, calls {result['calls']}")
    frames = {name: decode(vae, final, args.decode_frames) for name, final in latents.items()} if vae else {}
    compare(row["backends"], latents, frames)
    return row


def try_backend(model, name: str, processors, noise, texts, sigmas) -> tuple[dict, torch.Tensor | None]:
    """``run_backend``, or a row that says why the backend did not run: one backend failing must not lose the
    others' numbers."""
    if name == "fa4" and not fa4_installed():
        return {"available": False, "reason": "flash-attn-4 is not installed"}, None
    try:
        return run_backend(model, name, processors[name], noise, texts, sigmas)
    except Exception as e:  # a kernel that does not build, out of memory
        traceback.print_exc()
        return {"available": False, "reason": f"{type(e).__name__}: {e}"}, None


def compare(results: dict[str, dict], latents: dict[str, torch.Tensor], frames: dict[str, torch.Tensor]) -> None:
    """Speedups over FA4 and SDPA, and PSNR (latents, decoded frames) and SSIM (frames) against SDPA's run, into
    each available row."""
    for name, row in results.items():
        if not row["available"]:
            continue
        for base in ("fa4", "sdpa"):
            base_s = results[base]["s_per_step"] if results.get(base, {}).get("available") else None
            row[f"speedup_vs_{base}"] = base_s / row["s_per_step"] if base_s else None
        row["psnr_vs_sdpa_db"] = _against_sdpa(psnr, latents, name)
        row["frames_psnr_vs_sdpa_db"] = _against_sdpa(psnr, frames, name)
        row["frames_ssim_vs_sdpa"] = _against_sdpa(ssim, frames, name)


def _against_sdpa(metric, outputs: dict[str, torch.Tensor], name: str) -> float | None:
    ref = outputs.get("sdpa")
    if ref is None or name == "sdpa" or name not in outputs:
        return None
    return metric(outputs[name], ref, data_range=(ref.max() - ref.min()).item())


def table(rows: list[dict]) -> str:
    head = (
        f"{'size':>5} | {'backend':>7} | {'s/step':>7} | {'attn %':>6} | {'self %':>6} | {'peak GiB':>8} | "
        f"{'x FA4':>5} | {'x SDPA':>6} | {'PSNR dB':>7} | {'frames':>6} | {'SSIM':>6} | self-attention calls"
    )
    lines = [head, "-" * len(head)]
    for row in rows:
        for name in sorted(row["backends"]):
            r = row["backends"][name]
            if not r["available"]:
                lines.append(f"{row['size']:>5} | {name:>7} | unavailable: {r['reason']}")
                continue
            calls = ", ".join(f"{k.split(':')[1]} {n}" for k, n in r["calls"].items() if k.startswith("self:"))
            lines.append(
                f"{row['size']:>5} | {name:>7} | {r['s_per_step']:7.3f} | {r['attention_share']:6.0%} | "
                f"{r['self_attention_share']:6.0%} | {fmt(r['peak_memory_gib'], 8, '.2f')} | "
                f"{fmt(r['speedup_vs_fa4'], 5, '.2f')} | {fmt(r['speedup_vs_sdpa'], 6, '.2f')} | "
                f"{fmt(r['psnr_vs_sdpa_db'], 7, '.2f')} | {fmt(r['frames_psnr_vs_sdpa_db'], 6, '.2f')} | "
                f"{fmt(r['frames_ssim_vs_sdpa'], 6, '.4f')} | {calls}{'  FALLBACK' if 'fallback' in r else ''}"
            )
    return "\n".join(lines)


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
        "psnr_on": f"final latents, and {args.decode_frames} latent frames decoded by a random-weight Wan VAE; "
        "peaks = the sdpa run's range",
        "clocks_before": clocks() if device == "cuda" else None,
    }
    log(f"{meta['model']} ({meta['config']['num_layers']} layers, {meta['dtype']}) on {meta['device']}")
    if meta["clocks_before"]:
        log(f"clocks (sm, mem, temp, power) before: {meta['clocks_before']}")
    rows = []
    for size, latent in latent_sizes(args).items():
        order = rng.sample(names, len(names))
        rows.append(bench_size(model, vae, processors, size, latent, args, order, device))
    meta["clocks_after"] = clocks() if device == "cuda" else None
    if meta["clocks_after"]:
        log(f"clocks after: {meta['clocks_after']}")
    results = {"meta": meta, "rows": rows}
    cli.create_parent(args.json)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)
    log(f"wrote {args.json}; PSNR: final latents, then decoded frames, against the sdpa run")
    log(table(rows))
    return results


if __name__ == "__main__":
    main()
