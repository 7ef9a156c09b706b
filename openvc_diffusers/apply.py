"""``apply(pipe_or_model, config)``: install Open-VC on every transformer of a pipeline, with step tracking."""

from dataclasses import dataclass

import torch
from diffusers.models.attention_processor import AttnProcessor2_0

from .config import load_config
from .parallel import describe_degrees, enable_context_parallel
from .processors import (
    CogVideoXOpenVCProcessor,
    HunyuanVideo15OpenVCProcessor,
    HunyuanVideoOpenVCProcessor,
    LTXVideoOpenVCProcessor,
    MochiOpenVCProcessor,
    OpenVCProcessor,
    OpenVCProcessorBase,
)
from .processors.base import count_compiled_calls
from .steps import StepTracker

TRANSFORMER_ATTRS = ("transformer", "transformer_2")  # Wan 2.2 A14B has a high- and a low-noise expert


@dataclass(frozen=True)
class Family:
    name: str
    processor: type[OpenVCProcessorBase]
    keep: tuple[type, ...] = ()
    """Other processors in the same models, left to diffusers."""
    cross_attention: str | None = None
    """The name of the family's cross-attention modules (the others attend to the video tokens)."""

    @property
    def stock(self) -> tuple[type, ...]:
        """diffusers' processors that ``processor`` mirrors and replaces."""
        return self.processor.stock_processors


FAMILIES = (
    Family("Wan 2.1/2.2 and SkyReels-V2", OpenVCProcessor, cross_attention="attn2"),
    Family("LTX-Video", LTXVideoOpenVCProcessor, cross_attention="attn2"),
    # The text-token refiner's attention: 256 text tokens with a per-query mask, no video.
    Family("HunyuanVideo", HunyuanVideoOpenVCProcessor, keep=(AttnProcessor2_0,)),
    Family("HunyuanVideo-1.5", HunyuanVideo15OpenVCProcessor, keep=(AttnProcessor2_0,)),
    Family("CogVideoX", CogVideoXOpenVCProcessor),
    Family("Mochi", MochiOpenVCProcessor),
)
SUPPORTED = "; ".join(f"{f.name} ({', '.join(c.__name__ for c in f.stock)})" for f in FAMILIES)


def _family(processor) -> Family | None:
    # Exact types: a subclass of a stock processor may compute something else.
    for family in FAMILIES:
        if type(processor) in family.stock or type(processor) is family.processor:
            return family
    return None


def pipeline_transformers(target) -> list[torch.nn.Module]:
    """A pipeline's transformers (``transformer``, and ``transformer_2`` where there is one), or the model itself."""
    if isinstance(target, torch.nn.Module):
        return [target]
    found = [getattr(target, a) for a in TRANSFORMER_ATTRS if getattr(target, a, None) is not None]
    if not found:
        raise ValueError(
            f"apply() takes a pipeline with a transformer or a transformer model, got {type(target).__name__}"
        )
    return found


def _attention_to_replace(model: torch.nn.Module) -> tuple[Family, dict[torch.nn.Module, str]]:
    """The model's family and the attention modules whose processor Open-VC replaces, in module order, with their
    names; every other attention module must be one the family leaves to diffusers, so no attention is silently
    left out."""
    attention = {m: name for name, m in model.named_modules() if getattr(m, "processor", None) is not None}
    families = {m: _family(m.processor) for m in attention}
    found = {f for f in families.values() if f is not None}
    if len(found) != 1:
        names = ", ".join(sorted({type(m.processor).__name__ for m in attention})) or "no attention processors"
        raise ValueError(f"{type(model).__name__} is not supported ({names}); supported: {SUPPORTED}")
    (family,) = found
    uncovered = {type(m.processor) for m, f in families.items() if f is None} - set(family.keep)
    if uncovered:
        names = ", ".join(sorted(c.__name__ for c in uncovered))
        raise ValueError(f"{type(model).__name__} is {family.name} but has attention Open-VC does not cover: {names}")
    return family, {m: attention[m] for m, f in families.items() if f is family}


def apply(target, config=None) -> OpenVCProcessorBase:
    """Give the video attention of every transformer of ``target`` (a pipeline or a model) one shared Open-VC
    processor of its family, mirroring diffusers' own; other processors are refused with ``ValueError``.

    Numbers each transformer's self-attention layers in module order, for ``bf16_layers`` (before any call, so a
    compiled model makes no numbers: under caches that skip blocks too). Also tracks denoising steps from the
    transformers' ``timestep`` so ``bf16_steps`` applies, and with
    ``parallel.ulysses_degree`` or ``parallel.ring_degree`` above 1 shards each transformer's sequence over the
    torch.distributed world (``parallel.py``); a model sharded already (diffusers' ``enable_parallelism``) keeps
    its sharding under a config without parallel degrees and is refused one with them. Returns the processor (its
    ``calls`` counts which backend took which calls).
    """
    models = pipeline_transformers(target)
    plans = [_attention_to_replace(model) for model in models]
    families = {family for family, _ in plans}
    if len(families) != 1:
        raise ValueError(f"apply() takes transformers of one family, got {', '.join(sorted(f.name for f in families))}")
    config = load_config(config)
    sharding = _sharding_in_place(models, config)
    processor = plans[0][0].processor(config)
    processor.step_tracker = StepTracker(watched=config.bf16_steps)
    if config.ulysses_degree * config.ring_degree > 1:
        processor._parallel_config = enable_context_parallel(models, config.ulysses_degree, config.ring_degree)
    else:
        processor._parallel_config = sharding
    family = plans[0][0]
    for model, (_, modules) in zip(models, plans):
        processor.layer_count = 0  # each transformer (Wan 2.2's two experts) numbers its layers from 0
        for module, name in modules.items():
            # MochiAttention has no set_processor: its forward just calls the attribute.
            if hasattr(module, "set_processor"):
                module.set_processor(processor)
            else:
                module.processor = processor
            processor.route(module, is_cross=name.rsplit(".", 1)[-1] == family.cross_attention)
        model.register_forward_pre_hook(processor.step_tracker, with_kwargs=True)
        model.register_forward_pre_hook(count_compiled_calls)
    return processor


def _sharding_in_place(models: list[torch.nn.Module], config):
    """The context-parallel config the models run under already (diffusers' ``enable_parallelism``, or an earlier
    ``apply``), which a config without parallel degrees keeps; None where they are not sharded. ``ValueError``
    where the config would shard them a second time, or the transformers are not all sharded alike."""
    found = [getattr(model, "_parallel_config", None) for model in models]
    sharded = [c for c in found if c is not None and c.context_parallel_config is not None]
    if not sharded:
        return None
    name = type(models[0]).__name__
    if config.ulysses_degree * config.ring_degree > 1:
        raise ValueError(
            f"{name} is sharded already (by enable_parallelism or an earlier apply); "
            f"{describe_degrees(config.ulysses_degree, config.ring_degree)} would shard it twice: load the model "
            "again, or apply a config without parallel degrees (the sharding in place is kept)"
        )
    shardings = {(c.context_parallel_config.ulysses_degree, c.context_parallel_config.ring_degree) for c in sharded}
    if len(sharded) != len(models) or len(shardings) != 1:
        raise ValueError(
            f"the pipeline's {len(models)} transformers share one Open-VC processor, so they must be sharded alike; "
            f"{len(sharded)} are sharded, (ulysses_degree, ring_degree) {sorted(shardings)}"
        )
    return sharded[0]
