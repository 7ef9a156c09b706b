"""Generate the same video with diffusers' stock attention and with Open-VC, and compare them.

    python examples/generate.py                       # tiny random-weight Wan, no download
    python examples/generate.py --config my_policy.yaml --steps 8 --seed 1

Writes bf16.mp4, openvc.mp4 and side_by_side.mp4 (stock left, Open-VC right) to --output and prints
PSNR / SSIM between the two videos and each run's denoising time.
"""

import argparse
import os
import time

import numpy as np
import torch
from diffusers.utils import export_to_video

from openvc_diffusers import OpenVCProcessor
from openvc_diffusers.metrics import psnr, ssim
from openvc_diffusers.tiny import TINY_VIDEO, tiny_wan_pipeline


# The tiny model's sequences are far shorter than any real video's, so the default policy would send
# them all to the BF16 fallback; min_tokens 0 makes every eligible call take the FP8 path.
TINY_CONFIG = {"min_tokens": 0}
FPS = 8


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default="outputs", help="directory for the three mp4 files (default: outputs)")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps (default: 4)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial noise (default: 0)")
    parser.add_argument("--prompt", default="A red fox running through fresh snow at sunrise.", help="text prompt")
    parser.add_argument(
        "--config",
        default=None,
        help="YAML config for OpenVCProcessor. Default: {'min_tokens': 0}, because the tiny model's sequences "
        "are short enough that the default policy would keep every call on the BF16 fallback.",
    )
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cuda runs the model in bfloat16, cpu in float32 (default: cuda if available)",
    )
    # The tiny model's RoPE tables cover 32 positions per axis: up to 125 frames and 512 x 512 pixels.
    parser.add_argument("--frames", type=int, default=TINY_VIDEO["num_frames"], help="4k + 1 (default: %(default)s)")
    parser.add_argument("--height", type=int, default=TINY_VIDEO["height"], help="x16 (default: %(default)s)")
    parser.add_argument("--width", type=int, default=TINY_VIDEO["width"], help="x16 (default: %(default)s)")
    return parser.parse_args(argv)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def generate(pipe, args) -> tuple[np.ndarray, float]:
    """Run the pipeline once; return the video (F, H, W, C) in [0, 1] and the denoising time in seconds."""
    device = pipe.transformer.device
    start = end = None

    def on_transformer_call(module, inputs):
        nonlocal start
        if start is None:
            _synchronize(device)
            start = time.perf_counter()

    def on_step_end(pipe, step, timestep, callback_kwargs):
        nonlocal end
        _synchronize(device)
        end = time.perf_counter()
        return {}

    # Time only the denoising loop (first transformer call to the end of the last step), not text
    # encoding or VAE decoding, which attention does not touch.
    handle = pipe.transformer.register_forward_pre_hook(on_transformer_call)
    try:
        video = pipe(
            prompt=args.prompt,
            num_frames=args.frames,
            height=args.height,
            width=args.width,
            num_inference_steps=args.steps,
            # A CPU generator gives the same initial noise on every device.
            generator=torch.Generator().manual_seed(args.seed),
            output_type="np",
            callback_on_step_end=on_step_end,
        ).frames[0]
    finally:
        handle.remove()
    return video, end - start


def warm_up(pipe, args) -> None:
    # One-time CUDA costs (context, cuBLAS handles, kernel compilation) would otherwise land in the
    # first timed run; on CPU there are none worth a run.
    if pipe.transformer.device.type != "cuda":
        return
    pipe(
        prompt=args.prompt,
        num_frames=args.frames,
        height=args.height,
        width=args.width,
        num_inference_steps=1,
        output_type="latent",
    )


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    pipe = tiny_wan_pipeline(dtype=dtype, device=device)

    # The freshly built pipeline has diffusers' stock processors, so the reference run goes first.
    warm_up(pipe, args)
    bf16_video, bf16_time = generate(pipe, args)

    pipe.transformer.set_attn_processor(OpenVCProcessor(args.config or TINY_CONFIG))
    warm_up(pipe, args)
    openvc_video, openvc_time = generate(pipe, args)

    os.makedirs(args.output, exist_ok=True)
    videos = {
        "bf16.mp4": bf16_video,
        "openvc.mp4": openvc_video,
        "side_by_side.mp4": np.concatenate([bf16_video, openvc_video], axis=2),
    }
    for name, video in videos.items():
        export_to_video(list(video), os.path.join(args.output, name), fps=FPS)

    results = {
        "psnr": psnr(bf16_video, openvc_video),
        "ssim": ssim(bf16_video, openvc_video),
        "bf16_time": bf16_time,
        "openvc_time": openvc_time,
    }
    print(f"{args.steps} steps, {str(dtype).removeprefix('torch.')} on {device}")
    print(f"denoising time: stock attention {bf16_time:.2f} s, Open-VC {openvc_time:.2f} s")
    print(f"Open-VC vs stock: PSNR {results['psnr']:.2f} dB, SSIM {results['ssim']:.4f}")
    print(f"wrote {', '.join(os.path.join(args.output, name) for name in videos)}")
    return results


if __name__ == "__main__":
    main()
