"""The pipelines the example scripts run: a diffusers pipeline from the hub or a local folder, or the tiny
random Wan built in code, with the command-line arguments the scripts share."""

import argparse
import os

import torch
from diffusers import DiffusionPipeline
from huggingface_hub.errors import HFValidationError

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


class ModelNotAvailableError(Exception):
    """The weights named by ``--model`` are neither in a local folder nor reachable; the message says what to do."""


def add_pipeline_arguments(parser: argparse.ArgumentParser) -> None:
    """--model / --tiny, --device, and the prompt, seed and video size of the pipeline call."""
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
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cuda or cpu (default: cuda if available); the tiny model runs in float32 on the CPU",
    )
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="text prompt")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial noise (default: 0)")
    # The tiny model's RoPE tables cover 32 positions per axis: up to 125 frames and 512 x 512 pixels.
    for name, key, rule in (
        ("--frames", "num_frames", "4k + 1"),
        ("--height", "height", "x16"),
        ("--width", "width", "x16"),
    ):
        parser.add_argument(
            name, type=int, help=f"{rule} (default: {TINY_VIDEO[key]} with --tiny, the pipeline's own with --model)"
        )


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
    return DiffusionPipeline.from_pretrained(_local_folder(model), dtype=torch.bfloat16).to(device)


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
    ``super()._attend``) sees every call of any supported model, as ``(B, S, H, D)`` q, k, v. The mixed processor,
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
