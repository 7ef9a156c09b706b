"""Context parallelism (Ulysses x ring): diffusers shards the sequence, attention exchanges and passes it around.

diffusers' context-parallel hooks (the model's ``_cp_plan``) split the transformer's input along the sequence over
``ulysses_degree x ring_degree`` ranks and gather its output. Around each self-attention call, diffusers' own
``TemplatedUlyssesAttention`` exchanges sequence shards ``(B, S/(U R), H, D)`` for head shards ``(B, S/R, H/U, D)``
within the ulysses group (an all-to-all) and back after; in between, Open-VC attends: over the whole sequence where
the ring degree is 1, else over the ring group (``ring.py``). Quantization happens after the exchange, so with
Ulysses alone every per-block FP8 scale equals the single-GPU one. Rank ``r`` is ring rank ``r // U`` and Ulysses
rank ``r % U`` (diffusers' mesh ``(ring, ulysses)``), so each ring rank holds one contiguous stretch of the sequence.
"""

import torch
import torch.distributed as dist
from diffusers.hooks.context_parallel import apply_context_parallel
from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig
from diffusers.models.attention_dispatch import TemplatedUlyssesAttention
from torch.distributed.device_mesh import init_device_mesh

from openvc_kernels.forward_only import needs_grad

LAUNCH_HINT = "launch with `torchrun --nproc-per-node {degree} your_script.py` (or `accelerate launch`)"


def describe_degrees(ulysses_degree: int, ring_degree: int) -> str:
    """The YAML keys and values that set a sharding, for error messages."""
    if ring_degree == 1:
        return f"parallel.ulysses_degree {ulysses_degree}"
    if ulysses_degree == 1:
        return f"parallel.ring_degree {ring_degree}"
    return f"parallel.ulysses_degree {ulysses_degree} x parallel.ring_degree {ring_degree}"


def sharded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, parallel_config: ParallelConfig, attend):
    """Self-attention of this rank's ``(B, S/(U R), H, D)`` shard under ``parallel_config``; ``attend(q, k, v,
    ring_group, ring_degree)`` attends on the exchanged ``(B, S/R, H/U, D)`` tensors (``ring_group`` None: they hold
    the whole sequence)."""
    cp = parallel_config.context_parallel_config
    check_call(cp, q, k, v)
    ring_group = cp._ring_mesh.get_group() if cp.ring_degree > 1 else None
    if cp.ulysses_degree == 1:
        return attend(q, k, v, ring_group, cp.ring_degree)

    def forward_op(ctx, query, key, value, *args, **kwargs):  # diffusers' forward-op signature; the rest is defaults
        return attend(query, key, value, ring_group, cp.ring_degree)

    # No backward op: check_call refused calls that autograd records, so diffusers' backward never runs.
    no_mask, no_dropout, not_causal, default_scale, no_gqa, no_lse = None, 0.0, False, None, False, False
    return TemplatedUlyssesAttention.apply(
        q, k, v, no_mask, no_dropout, not_causal, default_scale, no_gqa, no_lse, forward_op, None, parallel_config
    )


def check_call(cp: ContextParallelConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise unless Open-VC can run this self-attention call sharded by ``cp``."""
    # diffusers 0.37 has neither ring_anything nor a mesh of the user's.
    ulysses_anything, ring_anything = cp.ulysses_anything, getattr(cp, "ring_anything", False)
    if ulysses_anything or ring_anything:
        raise ValueError(
            "Open-VC's context parallelism takes the even shards of ContextParallelConfig(ulysses_anything=False, "
            f"ring_anything=False), got ulysses_anything={ulysses_anything}, ring_anything={ring_anything}"
        )
    sharded_over, world = cp.ulysses_degree * cp.ring_degree, cp._world_size
    if getattr(cp, "mesh", None) is None and sharded_over != world:
        # diffusers builds a mesh of ulysses_degree x ring_degree processes; the ranks outside it fail there.
        raise ValueError(
            f"ContextParallelConfig(ulysses_degree={cp.ulysses_degree}, ring_degree={cp.ring_degree}) shards over "
            f"{sharded_over} processes, the world has {world}: make ulysses_degree x ring_degree the world size "
            "(or pass a mesh)"
        )
    heads = q.shape[2]
    if heads % cp.ulysses_degree:
        raise ValueError(f"ulysses_degree {cp.ulysses_degree} must divide the {heads} attention heads of this call")
    if needs_grad(q, k, v):
        # Open-VC and the ring's collectives have no backward, nor does diffusers' Ulysses without a backward op: a
        # gradient would be lost silently, or fail deep inside autograd.
        raise RuntimeError(
            "Open-VC's context parallelism is forward-only: run the sharded model under torch.no_grad() or "
            "torch.inference_mode(), or train with a diffusers attention backend that has a context-parallel backward"
        )


def check_model(model: torch.nn.Module, ulysses_degree: int, ring_degree: int) -> None:
    """Raise ``ValueError`` unless ``model`` can be sharded ``ulysses_degree x ring_degree`` in this process group."""
    name = type(model).__name__
    degrees = describe_degrees(ulysses_degree, ring_degree)
    world = ulysses_degree * ring_degree
    if getattr(model, "_cp_plan", None) is None:
        raise ValueError(
            f"{name} has no context-parallel plan (_cp_plan); {degrees} needs one (Wan, LTX-Video)"
        )
    heads = model.config.num_attention_heads
    if heads % ulysses_degree:
        raise ValueError(f"parallel.ulysses_degree {ulysses_degree} must divide {name}'s {heads} attention heads")
    if not dist.is_initialized():
        raise ValueError(f"{degrees} needs torch.distributed: {LAUNCH_HINT.format(degree=world)}")
    if dist.get_world_size() != world:
        raise ValueError(
            f"{degrees} needs a world of {world} processes, got {dist.get_world_size()}: "
            + LAUNCH_HINT.format(degree=world)
        )


def _video_tokens(model: torch.nn.Module, hidden_states: torch.Tensor) -> int:
    if hidden_states.dim() == 5:  # (B, C, F, H, W) latents, patchified by patch_size (t, h, w)
        t, h, w = model.config.patch_size
        return (hidden_states.shape[2] // t) * (hidden_states.shape[3] // h) * (hidden_states.shape[4] // w)
    return hidden_states.shape[1]  # already (B, S, C) tokens


def _even_shards_hook(ulysses_degree: int, ring_degree: int):
    # diffusers' hooks split the sequence with chunk(), and assert (with no numbers) where it does not divide; uneven
    # shards would make the exchanges' blocks differ in size. Runs before those hooks, on the whole input.
    def check(model, args, kwargs):
        hidden_states = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        tokens = _video_tokens(model, hidden_states)
        if tokens % (ulysses_degree * ring_degree):
            degrees = describe_degrees(ulysses_degree, ring_degree)
            raise ValueError(f"{degrees} must divide the {tokens} video tokens of this call")

    return check


def enable_context_parallel(models: list[torch.nn.Module], ulysses_degree: int, ring_degree: int) -> ParallelConfig:
    """Shard each model's sequence over the process group with diffusers' hooks; returns the one parallel config
    that the models' Open-VC processors take as ``_parallel_config``."""
    for model in models:
        check_model(model, ulysses_degree, ring_degree)
    device = next(models[0].parameters()).device
    cp_config = ContextParallelConfig(ulysses_degree=ulysses_degree, ring_degree=ring_degree)
    mesh = init_device_mesh(device.type, cp_config.mesh_shape, mesh_dim_names=cp_config.mesh_dim_names)
    config = ParallelConfig(context_parallel_config=cp_config)
    config.setup(dist.get_rank(), dist.get_world_size(), device, mesh=mesh)
    for model in models:
        model._parallel_config = config
        model.register_forward_pre_hook(_even_shards_hook(ulysses_degree, ring_degree), with_kwargs=True)
        apply_context_parallel(model, cp_config, model._cp_plan)
    return config
