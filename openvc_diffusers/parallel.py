"""Ulysses sequence parallelism: diffusers shards the sequence, attention exchanges sequence for heads.

diffusers' context-parallel hooks (the model's ``_cp_plan``) split the transformer's input along the sequence
and gather its output. Around each self-attention call the processor then does an all-to-all from sequence
shards ``(B, S/P, H, D)`` to head shards ``(B, S, H/P, D)``, attends over the whole sequence, and exchanges
back. Quantization happens after the exchange, so every per-block FP8 scale equals the single-GPU one.
"""

import torch
import torch.distributed as dist
from diffusers.hooks.context_parallel import apply_context_parallel
from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig
from torch.distributed.device_mesh import init_device_mesh

LAUNCH_HINT = "launch with `torchrun --nproc-per-node {degree} your_script.py` (or `accelerate launch`)"


def _all_to_all(chunks: torch.Tensor, group) -> torch.Tensor:
    """Chunk ``p`` of dim 0 goes to rank ``p``; chunk ``p`` of the result came from rank ``p``."""
    out = torch.empty_like(chunks)
    dist.all_to_all_single(out, chunks, group=group)
    return out


def sequence_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """``(B, S/P, H, D)`` sequence shard -> ``(B, S, H/P, D)``: the whole sequence for this rank's heads."""
    degree = dist.get_world_size(group)
    batch, shard, heads, dim = x.shape
    chunks = x.reshape(batch, shard, degree, heads // degree, dim).permute(2, 0, 1, 3, 4).contiguous()
    gathered = _all_to_all(chunks, group)  # (P, B, S/P, H/P, D): rank p's shard of the sequence
    return gathered.permute(1, 0, 2, 3, 4).reshape(batch, degree * shard, heads // degree, dim)


def heads_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """``(B, S, H/P, D)`` -> ``(B, S/P, H, D)``: all heads for this rank's shard of the sequence."""
    degree = dist.get_world_size(group)
    batch, seq, heads, dim = x.shape
    chunks = x.reshape(batch, degree, seq // degree, heads, dim).transpose(0, 1).contiguous()
    gathered = _all_to_all(chunks, group)  # (P, B, S/P, H/P, D): rank p's heads
    return gathered.permute(1, 2, 0, 3, 4).reshape(batch, seq // degree, degree * heads, dim)


def ulysses_group(parallel_config: ParallelConfig):
    return parallel_config.context_parallel_config._ulysses_mesh.get_group()


def check_ulysses(model: torch.nn.Module, degree: int) -> None:
    """Raise ``ValueError`` unless ``model`` can run Ulysses at ``degree`` in this process group."""
    name = type(model).__name__
    if getattr(model, "_cp_plan", None) is None:
        raise ValueError(f"{name} has no context-parallel plan (_cp_plan); Ulysses needs one (Wan, SkyReels-V2, LTX)")
    heads = model.config.num_attention_heads
    if heads % degree:
        raise ValueError(f"parallel.ulysses_degree {degree} must divide {name}'s {heads} attention heads")
    if not dist.is_initialized():
        raise ValueError(
            f"parallel.ulysses_degree {degree} needs torch.distributed: {LAUNCH_HINT.format(degree=degree)}"
        )
    if dist.get_world_size() != degree:
        raise ValueError(
            f"parallel.ulysses_degree {degree} needs a world of {degree} processes, got {dist.get_world_size()}: "
            + LAUNCH_HINT.format(degree=degree)
        )


def _video_tokens(model: torch.nn.Module, hidden_states: torch.Tensor) -> int:
    if hidden_states.dim() == 5:  # (B, C, F, H, W) latents, patchified by patch_size (t, h, w)
        t, h, w = model.config.patch_size
        return (hidden_states.shape[2] // t) * (hidden_states.shape[3] // h) * (hidden_states.shape[4] // w)
    return hidden_states.shape[1]  # already (B, S, C) tokens


def _even_shards_hook(degree: int):
    # diffusers' hooks split the sequence with chunk(): uneven shards would make the all-to-all exchange
    # blocks of different sizes. Runs before those hooks, on the whole input.
    def check(model, args, kwargs):
        hidden_states = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        tokens = _video_tokens(model, hidden_states)
        if tokens % degree:
            raise ValueError(f"parallel.ulysses_degree {degree} must divide the {tokens} video tokens of this call")

    return check


def enable_ulysses(models: list[torch.nn.Module], degree: int) -> ParallelConfig:
    """Shard each model's sequence over the process group with diffusers' hooks; returns the one parallel config
    that the models' Open-VC processors take as ``_parallel_config``."""
    for model in models:
        check_ulysses(model, degree)
    device = next(models[0].parameters()).device
    cp_config = ContextParallelConfig(ulysses_degree=degree)
    mesh = init_device_mesh(device.type, cp_config.mesh_shape, mesh_dim_names=cp_config.mesh_dim_names)
    config = ParallelConfig(context_parallel_config=cp_config)
    config.setup(dist.get_rank(), dist.get_world_size(), device, mesh=mesh)
    for model in models:
        model._parallel_config = config
        model.register_forward_pre_hook(_even_shards_hook(degree), with_kwargs=True)
        apply_context_parallel(model, cp_config, model._cp_plan)
    return config
