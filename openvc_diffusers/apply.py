"""``apply(pipe_or_model, config)``: install Open-VC on every transformer of a pipeline, with step tracking."""

import torch
from diffusers.models.transformers.transformer_wan import WanAttnProcessor

from .config import load_config
from .processors import OpenVCProcessor
from .steps import StepTracker

SUPPORTED_PROCESSORS = (WanAttnProcessor, OpenVCProcessor)
SUPPORTED_MODELS = "Wan 2.1/2.2 (WanTransformer3DModel), SkyReels-V2, and models with WanAttnProcessor"
TRANSFORMER_ATTRS = ("transformer", "transformer_2")  # Wan 2.2 A14B has a high- and a low-noise expert


def _transformers(target) -> list[torch.nn.Module]:
    if isinstance(target, torch.nn.Module):
        return [target]
    found = [getattr(target, a) for a in TRANSFORMER_ATTRS if getattr(target, a, None) is not None]
    if not found:
        raise ValueError(f"apply() takes a pipeline with a transformer or a transformer model, got {type(target).__name__}")
    return found


def _check_supported(model: torch.nn.Module) -> None:
    processors = getattr(model, "attn_processors", None)
    kinds = {type(p).__name__ for p in (processors or {}).values() if not isinstance(p, SUPPORTED_PROCESSORS)}
    if processors is None or not processors or kinds:
        found = ", ".join(sorted(kinds)) or "no attention processors"
        raise ValueError(f"{type(model).__name__} is not supported ({found}); supported: {SUPPORTED_MODELS}")


def apply(target, config=None) -> OpenVCProcessor:
    """Give every transformer of ``target`` (a pipeline or a model) one shared ``OpenVCProcessor``.

    Also tracks denoising steps from the transformers' ``timestep`` so ``bf16_steps`` applies.
    Returns the processor (its ``calls`` counts which backend took which calls).
    """
    models = _transformers(target)
    for model in models:
        _check_supported(model)
    processor = OpenVCProcessor(load_config(config))
    processor.step_tracker = StepTracker()
    for model in models:
        model.set_attn_processor(processor)
        model.register_forward_pre_hook(processor.step_tracker, with_kwargs=True)
    return processor
