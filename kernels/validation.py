"""Argument checks shared by the reference and the kernels: errors name the bad value and what is accepted."""

import math

import torch

from .quant import REPAIR_RANKINGS

INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_REPAIR_RATIO = 0.5


def check_attention_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    repair_ratio: float,
    window: int | None,
    repair_ranking: str = "energy",
    dtypes: tuple[torch.dtype, ...] = INPUT_DTYPES,
) -> None:
    """Raise ``ValueError`` unless q, k, v are ``(B, S, H, D)`` tensors that attention can take."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, seq_len, heads, head_dim), got shape {tuple(x.shape)}")
        if x.dtype not in dtypes:
            raise ValueError(f"{name} has dtype {x.dtype}; accepted: {', '.join(map(str, dtypes))}")
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device} but q is on {q.device}; all inputs must share a device")
        if x.dtype != q.dtype:
            raise ValueError(f"{name} has dtype {x.dtype} but q has {q.dtype}; all inputs must share a dtype")
        if min(x.shape) == 0:
            raise ValueError(f"{name} has an empty dimension: shape {tuple(x.shape)}")
    b, _, h, d = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if (k.shape[0], k.shape[2], k.shape[3]) != (b, h, d):
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in batch, heads and head_dim "
            "(layout (batch, seq_len, heads, head_dim))"
        )
    check_repair_ratio(repair_ratio)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 0):
        raise ValueError(f"window must be an int >= 0 or None (plain order), got {window!r}")
    if repair_ranking not in REPAIR_RANKINGS:
        raise ValueError(
            f"repair_ranking must be one of {', '.join(map(repr, REPAIR_RANKINGS))}, got {repair_ranking!r}"
        )


def check_repair_ratio(repair_ratio: float) -> None:
    if (
        isinstance(repair_ratio, bool)
        or not isinstance(repair_ratio, (int, float))
        or not math.isfinite(repair_ratio)
        or not 0.0 <= repair_ratio <= MAX_REPAIR_RATIO
    ):
        raise ValueError(f"repair_ratio must be a finite number in [0, {MAX_REPAIR_RATIO}], got {repair_ratio!r}")
