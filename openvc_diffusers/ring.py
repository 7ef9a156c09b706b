"""Ring attention for Open-VC: each rank holds one shard of the sequence; its queries attend to every K/V shard.

The FP8 scales are agreed on before any shard is attended to, so that every shard's bytes are the unsplit call's:

- V: one scale per head. Each rank's per-head absmax of its V shard is all-reduced (max); every shard call quantizes
  V with that ``v_absmax``, so each shard's V8 bytes equal the unsplit call's.
- K (with ``smooth_k``): the channel mean subtracted before quantizing is the unsplit call's, over every 8th key of
  the whole sequence (``quant.channel_mean``): each rank sums those of its shard, the channel sums and counts are
  all-reduced (sum) and every shard call subtracts that ``k_mean``.
- Q and K blocks of 128 tokens start at each shard's first token: where the shard length is a multiple of 128 they
  are the unsplit call's blocks, else the blocks (and their scales) differ at the shard edges.
- V residual repair: each shard call repairs ``round(rho * shard length)`` of its own keys, ranked with the shared
  ``d_V``. This is the one place where the result depends on the sharding beyond rounding: the unsplit call repairs
  the ``round(rho * S)`` keys of largest residual energy over the whole sequence, the ring the largest of each shard
  (and with ``repair_ranking: attention`` ranks them by the attention mass from this rank's queries).

The K/V shards travel by one all-gather per call, as in diffusers' own ring attention (its only ``rotate_method``),
not by send/recv around the ring: the same bytes cross the links, in one collective that NCCL schedules as a whole,
and the code stays one loop over shards. What send/recv would buy is overlap of the next shard's transfer with the
current shard's kernel and a memory bound of two shards; here every rank holds all R shards of K and V for the
length of the call (Wan 14B at 720p, Ulysses degree 8: 75,600 tokens x 5 heads x 128 x 2 bytes x 2, about 0.2 GB),
and the transfer (about 4 bytes of K and V per key and head, against 512 FLOP per score) is small next to the
attention of long sequences.

Each shard call returns its output and each row's log-sum-exp; ``openvc_kernels.merge_attention`` merges them in
FP32. The shard calls' ExpCast codes sit on each shard's own row max (as the kernel's tail split's pieces do), so the
merged output differs from the unsplit call's at the FP8 rounding level, equally close to exact attention.
"""

from collections.abc import Callable

import torch
import torch.distributed as dist

import openvc_kernels
from openvc_kernels.quant import mean_keys

ShardAttention = Callable[..., tuple[torch.Tensor, torch.Tensor]]
"""``(q, k, v, *, return_lse=True, v_absmax, k_mean) -> (out, lse)``: one Open-VC call on one K/V shard."""


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """``(B, S/R, H, D)`` shard -> ``(B, S, H, D)``: the shards of every rank of ``group``, in rank order."""
    shards = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, x.contiguous(), group=group)
    return torch.cat(shards, dim=1)


def shared_v_absmax(v: torch.Tensor, group) -> torch.Tensor:
    """V's per-head absmax over every rank's shard: ``(B, H)`` fp32."""
    absmax = v.abs().amax(dim=(1, 3)).float()
    dist.all_reduce(absmax, op=dist.ReduceOp.MAX, group=group)
    return absmax


def shared_k_mean(k: torch.Tensor, group) -> torch.Tensor:
    """``quant.channel_mean`` of the whole sequence from every rank's equal shard: ``(B, H, D)`` fp32, over the same
    keys (``quant.mean_keys``), summed in FP32 in another order."""
    read = mean_keys(k, dist.get_rank(group) * k.shape[1])
    sums = read.sum(dim=1, dtype=torch.float32)  # (B, H, D)
    count = sums.new_full((*sums.shape[:-1], 1), read.shape[1])
    totals = torch.cat([sums, count], dim=-1)
    dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=group)
    return totals[..., :-1] / totals[..., -1:]


def attend_key_shards(
    q: torch.Tensor,
    k_shards: list[torch.Tensor],
    v_shards: list[torch.Tensor],
    attend_shard: ShardAttention,
    *,
    v_absmax: torch.Tensor,
    k_mean: torch.Tensor | None,
) -> torch.Tensor:
    """The local queries against each K/V shard with the shared scales, merged: ``(B, S_q, H, D)`` in q's dtype."""
    outs, lses = [], []
    for k, v in zip(k_shards, v_shards):
        out, lse = attend_shard(q, k, v, return_lse=True, v_absmax=v_absmax, k_mean=k_mean)
        outs.append(out)
        lses.append(lse)
    out, _ = openvc_kernels.merge_attention(outs, lses)
    return out.to(q.dtype)


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, attend_shard: ShardAttention, *, smooth_k: bool
) -> torch.Tensor:
    """Self-attention of this rank's ``(B, S/R, H, D)`` shard of q, k, v over the whole sequence, which the ranks of
    ``group`` hold in rank order: ``(B, S/R, H, D)`` out."""
    v_absmax = shared_v_absmax(v, group)
    k_mean = shared_k_mean(k, group) if smooth_k else None
    degree = dist.get_world_size(group)
    k_shards = gather_sequence(k, group).chunk(degree, dim=1)
    v_shards = gather_sequence(v, group).chunk(degree, dim=1)
    return attend_key_shards(q, k_shards, v_shards, attend_shard, v_absmax=v_absmax, k_mean=k_mean)
