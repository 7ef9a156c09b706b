"""Argument checks shared by every attention path: errors name the bad value and what is accepted.

``check_qkv`` is the one structural check of q, k, v (the policy runs it on every call, whichever backend takes
it, so a bad call fails alike everywhere); ``check_attention_args`` adds the dtypes and options of the reference
and the kernel.
"""

import math

import torch

from .repair import REPAIR_RANKINGS

INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""What the reference takes (the kernel: fp16 and bf16)."""
MAX_REPAIR_RATIO = 0.5


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise ``ValueError`` unless q, k, v are floating-point ``(B, S, H, D)`` tensors of one device and dtype,
    with k and v of one shape and q agreeing with them in batch, heads and head_dim (S_q may differ)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, seq_len, heads, head_dim), got shape {tuple(x.shape)}")
        if not x.dtype.is_floating_point or x.dtype.itemsize < 2:
            raise ValueError(f"{name} has dtype {x.dtype}; attention takes float16, bfloat16, float32 or float64")
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
    """``check_qkv``, then q's dtype among ``dtypes`` and the Open-VC options; ``ValueError`` otherwise."""
    check_qkv(q, k, v)
    if q.dtype not in dtypes:
        raise ValueError(f"q, k, v have dtype {q.dtype}; accepted: {', '.join(map(str, dtypes))}")
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
