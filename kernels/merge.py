"""Merging attention over disjoint key sets from each part's output and log-sum-exp (a ring of K/V shards).

With ``lse = logsumexp_i lse_i`` the softmax over all keys is ``sum_i exp(lse_i - lse) out_i``: each part's output
is its own softmax-weighted average, and ``exp(lse_i - lse)`` is the share of the total weight its keys hold.
"""

import torch


def merge_attention(
    outs: list[torch.Tensor] | tuple[torch.Tensor, ...], lses: list[torch.Tensor] | tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge the parts ``outs[i]`` (B, S, H, D) and ``lses[i]`` (B, S, H) of one attention over disjoint key sets:
    ``out = sum_i exp(lse_i - lse) out_i`` in FP32 with ``lse = logsumexp_i lse_i``. Returns ``(out, lse)``, out in
    the dtype of ``outs[0]``, lse FP32. A row whose lse is -inf in every part (no key anywhere) gets out 0 and lse
    -inf, not NaN. ``ValueError`` for empty or mismatched inputs."""
    _check_parts(outs, lses)
    lse_parts = torch.stack([lse.float() for lse in lses])
    lse = torch.logsumexp(lse_parts, dim=0)
    # A row with no weight anywhere: exp(-inf - 0) = 0 for every part, where exp(-inf - -inf) would be NaN.
    finite_lse = torch.where(lse == -torch.inf, torch.zeros_like(lse), lse)
    weights = torch.exp(lse_parts - finite_lse)
    out = torch.zeros(outs[0].shape, dtype=torch.float32, device=outs[0].device)
    for weight, part in zip(weights, outs):
        out.addcmul_(weight[..., None], part.float())
    return out.to(outs[0].dtype), lse


def _check_parts(outs, lses) -> None:
    if not isinstance(outs, (list, tuple)) or not isinstance(lses, (list, tuple)):
        raise ValueError(
            f"outs and lses must be lists of tensors, got {type(outs).__name__} and {type(lses).__name__}"
        )
    if len(outs) == 0:
        raise ValueError("merge_attention needs at least one part: outs and lses are empty")
    if len(outs) != len(lses):
        raise ValueError(f"outs has {len(outs)} parts but lses has {len(lses)}; pass one lse per output")
    first = outs[0]
    if not isinstance(first, torch.Tensor) or first.dim() != 4:
        raise ValueError(f"outs[0] must be a 4-D tensor (batch, seq_len, heads, head_dim), got {_describe(first)}")
    for i, (out, lse) in enumerate(zip(outs, lses)):
        if not isinstance(out, torch.Tensor) or out.shape != first.shape:
            raise ValueError(f"outs[{i}] is {_describe(out)}; every part's output must have outs[0]'s shape "
                             f"{tuple(first.shape)}")
        if not isinstance(lse, torch.Tensor) or lse.shape != first.shape[:-1]:
            raise ValueError(f"lses[{i}] is {_describe(lse)}; accepted: shape (batch, seq_len, heads) = "
                             f"{tuple(first.shape[:-1])}, outs' shape without head_dim")
        if not out.dtype.is_floating_point or not lse.dtype.is_floating_point:
            raise ValueError(f"part {i} has dtypes {out.dtype} and {lse.dtype}; outs and lses must be floating point")
        if out.device != first.device or lse.device != first.device:
            raise ValueError(f"part {i} is on {out.device} and {lse.device}; every part must be on {first.device}")


def _describe(x) -> str:
    return f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
