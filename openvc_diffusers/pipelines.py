"""The pipelines the example scripts run: a diffusers pipeline from the hub or a local folder, or the tiny
random Wan built in code, with the command-line arguments the scripts share."""

import argparse
import os

import diffusers
import torch
from diffusers import DiffusionPipeline
from huggingface_hub.errors import HFValidationError
from packaging.version import Version

from . import cli
from .apply import apply, pipeline_transformers
from .processors import OpenVCProcessorBase
from .tiny import TINY_VIDEO, tiny_wan_pipeline

# The tiny model's sequences are far shorter than any real video's, so the default policy would send
# them all to the BF16 fallback; min_tokens 0 makes every eligible call take the FP8 path.
TINY_CONFIG = {"min_tokens": 0}
TINY_STEPS = 4
DEFAULT_PROMPT = "A red fox running through fresh snow at sunrise."
_MODEL_HINT = (
    "--model takes a Hugging Face hub id or a local folder holding a diffusers pipeline "
    "(model_index.json and a subfolder per component)."
)


# from_pretrained's dtype argument: diffusers 0.42 named it `dtype` (`torch_dtype` deprecated); before, `dtype` was
# ignored and the weights loaded in float32.
DTYPE_KEYWORD = "dtype" if Version(diffusers.__version__) >= Version("0.42") else "torch_dtype"


class ModelNotAvailableError(Exception):
    """The weights named by ``--model`` are neither in a local folder nor reachable; the message says what to do."""


# Wan's VAE compresses 8x in space and 4x in time (after the first frame), and its transformer patches 2 x 2
# latents: heights and widths are multiples of 16, frame counts 4k + 1. The tiny model is a Wan.
PIXEL_STEP = 16
FRAME_STEP = 4
# The positions per axis of the tiny transformer's RoPE tables (tiny.py's rope_max_seq_len): one per patch
# (16 px) in height and width, one per latent frame in time.
TINY_ROPE_POSITIONS = 32
TINY_MAX_PIXELS = TINY_ROPE_POSITIONS * PIXEL_STEP  # 512
TINY_MAX_FRAMES = (TINY_ROPE_POSITIONS - 1) * FRAME_STEP + 1  # 125


def add_pipeline_arguments(parser: argparse.ArgumentParser) -> None:
    """--model / --tiny, --device, and the prompt, seed and video size of the pipeline call; the scripts check
    the size against the model with ``check_pipeline_arguments``."""
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--model",
        help="a diffusers text-to-video pipeline: a Hugging Face hub id such as Wan-AI/Wan2.1-T2V-1.3B-Diffusers, "
        "or a local folder holding one (model_index.json and a subfolder per component); loaded in bfloat16",
    )
    which.add_argument(
        "--tiny", action="store_true", help="the tiny random-weight Wan pipeline built in code (the default)"
    )
    parser.add_argument(
        "--device",
        type=cli.device,
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cpu, cuda or cuda:N (default: cuda if available); the tiny model runs in float32 on the CPU",
    )
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="text prompt")
    parser.add_argument("--seed", type=cli.seed, default=0, help="seed of the initial noise (default: 0)")
    for name, key, rule, tiny_most in (
        ("--frames", "num_frames", "4k + 1", TINY_MAX_FRAMES),
        ("--height", "height", "a multiple of 16", TINY_MAX_PIXELS),
        ("--width", "width", "a multiple of 16", TINY_MAX_PIXELS),
    ):
        parser.add_argument(
            name,
            type=cli.positive_int,
            help=f"with --tiny: {rule}, at most {tiny_most} (default: {TINY_VIDEO[key]}); with --model: what that "
            "pipeline takes (default: its own)",
        )


WAN_SIZE_RULES = {
    # flag: (step, offset, rule, why)
    "--frames": (FRAME_STEP, 1, "of the form 4k + 1", "Wan's VAE encodes the first frame alone, then 4 per latent"),
    "--height": (PIXEL_STEP, 0, "a multiple of 16", "Wan's VAE downsamples 8x and its transformer patches 2x2"),
    "--width": (PIXEL_STEP, 0, "a multiple of 16", "Wan's VAE downsamples 8x and its transformer patches 2x2"),
}


def _size_error(flag: str, value: int) -> str | None:
    """Why ``value`` breaks Wan's rule for ``flag``, with the two nearest values that keep it; None if it keeps it."""
    step, offset, rule, why = WAN_SIZE_RULES[flag]
    if value % step == offset:
        return None
    below = (value - offset) // step * step + offset
    nearest = f"{below} or {below + step}" if below > 0 else str(below + step)
    return f"{value} is not {rule} ({why}); try {nearest}"


def check_pipeline_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The tiny model's video size: Wan's rules and the reach of its RoPE tables. With ``--model`` the size is
    left to that pipeline's own checks, whose rules differ by family (Mochi takes 6k + 1 frames, LTX multiples of
    32 pixels)."""
    if args.model is not None:
        return
    rope = f"its RoPE covers {TINY_ROPE_POSITIONS}"
    for flag, value, most, reach in (
        ("--frames", args.frames, TINY_MAX_FRAMES, f"{rope} latent frames"),
        ("--height", args.height, TINY_MAX_PIXELS, f"{rope} patches of {PIXEL_STEP} px"),
        ("--width", args.width, TINY_MAX_PIXELS, f"{rope} patches of {PIXEL_STEP} px"),
    ):
        if value is None:
            continue
        error = _size_error(flag, value)
        if error is None and value > most:
            error = f"{value} is more than the tiny model's {most} ({reach}); --model runs larger videos"
        if error is not None:
            parser.error(f"argument {flag}: {error}")


def call_kwargs(args: argparse.Namespace) -> dict:
    """Prompt, video size and a freshly seeded generator for one pipeline call; the tiny model's size unless given."""
    size = {"num_frames": args.frames, "height": args.height, "width": args.width}
    if args.model is None:
        size = {key: TINY_VIDEO[key] if value is None else value for key, value in size.items()}
    # A CPU generator gives the same initial noise on every device.
    generator = torch.Generator().manual_seed(args.seed)
    return {"prompt": args.prompt, "generator": generator, **{k: v for k, v in size.items() if v is not None}}


def steps_kwargs(args: argparse.Namespace, steps: int | None) -> dict:
    """``num_inference_steps`` for the pipeline call: ``steps`` if given, else TINY_STEPS for the tiny model and
    nothing (the pipeline's own default) for a real one."""
    if steps is None:
        return {} if args.model is not None else {"num_inference_steps": TINY_STEPS}
    return {"num_inference_steps": steps}


def load_pipeline(model: str | None = None, device: str | torch.device = "cpu") -> DiffusionPipeline:
    """The pipeline at ``model`` (hub id or local folder) in bfloat16, or the tiny Wan for ``None``.

    The tiny pipeline runs in bfloat16 on CUDA and in float32 on the CPU. Raises ``ModelNotAvailableError``
    when the weights can be neither found locally nor downloaded.
    """
    if model is None:
        dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
        return tiny_wan_pipeline(dtype=dtype, device=device)
    return DiffusionPipeline.from_pretrained(_local_folder(model), **{DTYPE_KEYWORD: torch.bfloat16}).to(device)


def _local_folder(model: str) -> str:
    """The folder holding ``model``: itself, or its snapshot in the hub cache (downloaded if needed)."""
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "model_index.json")):
            raise ModelNotAvailableError(f"--model {model!r} is a folder without model_index.json. {_MODEL_HINT}")
        return model
    # Download separately from loading, so that only hub and cache errors get the messages below.
    try:
        return DiffusionPipeline.download(model)
    except HFValidationError as e:
        raise ModelNotAvailableError(f"--model {model!r} is neither a local folder nor a hub id. {_MODEL_HINT}") from e
    except OSError as e:  # offline, not found, gated or unreachable
        cause = e.__cause__ or e
        raise ModelNotAvailableError(
            f"Cannot load --model {model!r}: it is not a local folder, and the Hugging Face hub could not provide it "
            f"({type(cause).__name__}: {str(cause).splitlines()[0]})\n{_MODEL_HINT} Without network here, download "
            f"it where there is network (`hf download {model} --local-dir /path/to/model`), copy the folder to this "
            "machine and pass `--model /path/to/model`."
        ) from e


def install(target, mixin: type, config=None, **kwargs) -> OpenVCProcessorBase:
    """``openvc_diffusers.apply(target, config)`` with ``mixin`` put in front of the family processor it picks.

    Every family's processor hands each attention call to ``_attend``, so a mixin that overrides it (calling
    ``super()._attend``) sees every call of any supported model, as ``(B, S, H, D)`` q, k, v (in eager inference
    Wan's q and k before the rotary embedding, whose tables come in the ``rotary`` option). The mixed processor,
    built as ``(mixin, family)(config, **kwargs)``, takes the place of apply's on the same modules, with its step
    tracker.
    """
    applied = apply(target, config)
    family = type(applied)
    processor = type(mixin.__name__ + family.__name__, (mixin, family), {})(applied.config, **kwargs)
    processor.step_tracker = applied.step_tracker
    processor._parallel_config = applied._parallel_config
    for model in pipeline_transformers(target):
        for module in model.modules():
            if getattr(module, "processor", None) is applied:
                # All set_processor does for a processor that is not a torch module (Mochi's has none).
                module.processor = processor
    return processor
