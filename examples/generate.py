"""Generate the same video with diffusers' stock attention and with Open-VC, and compare them.

    python examples/generate.py                       # tiny random-weight Wan, no download
    python examples/generate.py --config my_policy.yaml --steps 8 --seed 1
    python examples/generate.py --model Wan-AI/Wan2.1-T2V-1.3B-Diffusers --steps 30

Writes bf16.mp4, openvc.mp4 and side_by_side.mp4 (stock left, Open-VC right) to --output and prints
PSNR / SSIM between the two videos and each run's denoising time.
"""

import argparse
import os
import sys
import time

import numpy as np
import torch
from diffusers.utils import export_to_video

import openvc_diffusers
from openvc_diffusers import cli
from openvc_diffusers.metrics import psnr, ssim
from openvc_diffusers.pipelines import (
    TINY_CONFIG,
    TINY_STEPS,
    ModelNotAvailableError,
    add_pipeline_arguments,
    call_kwargs,
    check_pipeline_arguments,
    load_pipeline,
    pipeline_transformers,
    steps_kwargs,
)
from openvc_diffusers.video import writer_missing


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pipeline_arguments(parser)
    parser.add_argument(
        "--output",
        type=cli.writable_dir,
        default="outputs",
        help="directory for the three mp4 files (default: outputs)",
    )
    parser.add_argument(
        "--steps",
        type=cli.positive_int,
        help=f"denoising steps (default: {TINY_STEPS} with --tiny, the pipeline's own with --model)",
    )
    parser.add_argument(
        "--config",
        type=cli.single_process_config,
        help="YAML config for Open-VC. Default with --tiny: {'min_tokens': 0}, because the tiny model's sequences "
        "are short enough that the default policy would keep every call on the BF16 fallback; with --model: "
        "the defaults (configs/default.yaml).",
    )
    parser.add_argument(
        "--fps", type=cli.positive_int, default=16, help="frame rate of the written videos (default: 16)"
    )
    args = parser.parse_args(argv)
    check_pipeline_arguments(parser, args)
    return args


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def generate(pipe, args) -> tuple[np.ndarray, float]:
    """Run the pipeline once; return the video (F, H, W, C) in [0, 1] and the denoising time in seconds."""
    transformers = pipeline_transformers(pipe)
    device = transformers[0].device
    start = end = None

    def on_transformer_start(module, inputs):
        nonlocal start
        if start is None:
            _synchronize(device)
            start = time.perf_counter()

    def on_transformer_end(module, inputs, output):
        nonlocal end
        _synchronize(device)
        end = time.perf_counter()

    # Time only the denoising loop (first transformer call to the end of the last one), not text encoding
    # or VAE decoding, which attention does not touch. Hooks rather than a step callback: not every
    # pipeline takes callback_on_step_end.
    handles = [t.register_forward_pre_hook(on_transformer_start) for t in transformers]
    handles += [t.register_forward_hook(on_transformer_end) for t in transformers]
    try:
        video = pipe(**call_kwargs(args), **steps_kwargs(args, args.steps), output_type="np").frames[0]
    finally:
        for handle in handles:
            handle.remove()
    return video, end - start


def warm_up(pipe, args) -> None:
    # One-time CUDA costs (context, cuBLAS handles, kernel compilation) would otherwise land in the
    # first timed run; on CPU there are none worth a run.
    if pipe.device.type != "cuda":
        return
    pipe(**call_kwargs(args), num_inference_steps=1, output_type="latent")


def main(argv=None) -> dict:
    args = parse_args(argv)
    if (reason := writer_missing()) is not None:
        sys.exit(f"Cannot write the videos: {reason}")  # before minutes of denoising, not after
    try:
        pipe = load_pipeline(args.model, args.device)
    except ModelNotAvailableError as e:
        sys.exit(str(e))

    # The freshly loaded pipeline has diffusers' stock processors, so the reference run goes first.
    warm_up(pipe, args)
    bf16_video, bf16_time = generate(pipe, args)

    processor = openvc_diffusers.apply(pipe, args.config or (TINY_CONFIG if args.model is None else None))
    warm_up(pipe, args)
    processor.calls.clear()  # count the timed run's calls only
    openvc_video, openvc_time = generate(pipe, args)

    results = {
        "psnr": psnr(bf16_video, openvc_video),
        "ssim": ssim(bf16_video, openvc_video),
        "bf16_time": bf16_time,
        "openvc_time": openvc_time,
        "calls": dict(processor.calls),
    }
    dtype = str(pipe.transformer.dtype).removeprefix("torch.")
    print(f"{args.model or 'tiny random Wan'}: {dtype} on {pipe.device}")
    calls = ", ".join(f"{kind}-attention {backend} {n}" for (kind, backend), n in sorted(processor.calls.items()))
    print(f"Open-VC run, calls per backend: {calls}")
    print(f"denoising time: stock attention {bf16_time:.2f} s, Open-VC {openvc_time:.2f} s")
    print(f"Open-VC vs stock: PSNR {results['psnr']:.2f} dB, SSIM {results['ssim']:.4f}", flush=True)

    os.makedirs(args.output, exist_ok=True)
    videos = {
        "bf16.mp4": bf16_video,
        "openvc.mp4": openvc_video,
        "side_by_side.mp4": np.concatenate([bf16_video, openvc_video], axis=2),
    }
    for name, video in videos.items():
        export_to_video(list(video), os.path.join(args.output, name), fps=args.fps)
    print(f"wrote {', '.join(os.path.join(args.output, name) for name in videos)}")
    return results


if __name__ == "__main__":
    main()
