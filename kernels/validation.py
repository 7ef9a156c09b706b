"""Argument checks shared by every attention path: errors name the bad value and what is accepted.

``check_qkv`` is the one structural check of q, k, v (the policy runs it on every call, whichever backend takes
it, so a bad call fails alike everywhere); ``check_attention_args`` adds the dtypes and options of the reference
and the kernel.
"""

import math
import numbers

import torch

from .repair import REPAIR_RANKINGS

INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""What the reference takes (the kernel: fp16 and bf16)."""
QKV_DTYPES = frozenset((*INPUT_DTYPES, torch.float64))
"""What ``check_qkv`` takes: every floating-point dtype of two bytes or more (float64 goes to a fallback)."""
MAX_REPAIR_RATIO = 0.5


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise ``ValueError`` unless q, k, v are floating-point ``(B, S, H, D)`` tensors of one device and dtype,
    with k and v of one shape and q agreeing with them in batch, heads and head_dim (S_q may differ)."""
    # Each tensor's shape, dtype and device read once: every read is host time on every call.
    q_dtype = q_device = None
    shapes = []
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        shape, dtype, device = x.shape, x.dtype, x.device
        if len(shape) != 4:
            raise ValueError(f"{name} must be 4-D (batch, seq_len, heads, head_dim), got shape {tuple(shape)}")
        if dtype not in QKV_DTYPES:
            raise ValueError(f"{name} has dtype {dtype}; attention takes float16, bfloat16, float32 or float64")
        if name == "q":
            q_dtype, q_device = dtype, device
        if device != q_device:
            raise ValueError(f"{name} is on {device} but q is on {q_device}; all inputs must share a device")
        if dtype != q_dtype:
            raise ValueError(f"{name} has dtype {dtype} but q has {q_dtype}; all inputs must share a dtype")
        if 0 in shape:
            raise ValueError(f"{name} has an empty dimension: shape {tuple(shape)}")
        shapes.append(shape)
    q_shape, k_shape, v_shape = shapes
    b, _, h, d = q_shape
    if k_shape != v_shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k_shape)} and {tuple(v_shape)}")
    if (k_shape[0], k_shape[2], k_shape[3]) != (b, h, d):
        raise ValueError(
            f"q {tuple(q_shape)} and k {tuple(k_shape)} must agree in batch, heads and head_dim "
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
    softmax_scale: float | None = None,
    dtypes: tuple[torch.dtype, ...] = INPUT_DTYPES,
) -> None:
    """``check_qkv``, then q's dtype among ``dtypes`` and the Open-VC options; ``ValueError`` otherwise."""
    check_qkv(q, k, v)
    if q.dtype not in dtypes:
        raise ValueError(f"q, k, v have dtype {q.dtype}; accepted: {', '.join(map(str, dtypes))}")
    check_repair_ratio(repair_ratio)
    if softmax_scale is not None:
        check_softmax_scale(softmax_scale)
    check_window(window)
    if repair_ranking not in REPAIR_RANKINGS:
        raise ValueError(
            f"repair_ranking must be one of {', '.join(map(repr, REPAIR_RANKINGS))}, got {repair_ranking!r}"
        )


def check_window(window: int | None) -> None:
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 0):
        raise ValueError(f"window must be an int >= 0 or None (plain order), got {window!r}")


def check_flag(name: str, value: bool) -> None:
    """A bool: any other value would be taken for its truth (``"no"`` for True), not refused."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def check_softmax_scale(softmax_scale: float) -> None:
    """A finite number > 0: ExpCast's anchor follows the row's largest scaled score only for a positive scale (with
    a negative one every row's output would be silently wrong), and NaN or inf scales give no scores at all."""
    if (
        isinstance(softmax_scale, bool)
        or not isinstance(softmax_scale, numbers.Real)
        or not math.isfinite(softmax_scale)
        or softmax_scale <= 0
    ):
        raise ValueError(
            f"softmax_scale must be a finite number > 0 (or None: 1 / sqrt(head_dim)), got {softmax_scale!r}"
        )


def check_repair_ratio(repair_ratio: float) -> None:
    if (
        isinstance(repair_ratio, bool)
        or not isinstance(repair_ratio, (int, float))
        or not math.isfinite(repair_ratio)
        or not 0.0 <= repair_ratio <= MAX_REPAIR_RATIO
    ):
        raise ValueError(f"repair_ratio must be a finite number in [0, {MAX_REPAIR_RATIO}], got {repair_ratio!r}")


def check_shared_scales(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    smooth_k: bool,
    v_absmax: torch.Tensor | None,
    k_mean: torch.Tensor | None,
    values: bool = True,
) -> None:
    """Raise ``ValueError`` unless ``smooth_k`` is a bool and ``v_absmax`` and ``k_mean`` are None or FP32 tensors
    on q's device of shapes (B, H) and (B, H, D) for ``(B, S, H, D)`` k, ``k_mean`` only with ``smooth_k``; with
    ``values``, also finite and ``v_absmax >= 0`` (a check that waits for the device: callers skip it while
    capturing a CUDA graph)."""
    b, _, h, d = k.shape
    check_flag("smooth_k", smooth_k)
    if k_mean is not None and not smooth_k:
        raise ValueError("k_mean is the mean K smoothing subtracts: pass it with smooth_k=True, or leave it None")
    for name, x, shape in (("v_absmax", v_absmax, (b, h)), ("k_mean", k_mean, (b, h, d))):
        if x is None:
            continue
        dims = "(batch, heads, head_dim)" if len(shape) == 3 else "(batch, heads)"
        accepted = f"accepted: None or a float32 tensor of shape {dims} = {shape} on {q.device}"
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}; {accepted}")
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)}; {accepted}")
        if x.dtype != torch.float32:
            raise ValueError(f"{name} has dtype {x.dtype}; {accepted}")
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device}; {accepted}")
        if values and not bool(torch.isfinite(x).all()):
            raise ValueError(f"{name} holds inf or NaN; accepted: finite values")
        if values and name == "v_absmax" and bool((x < 0).any()):
            raise ValueError(f"v_absmax holds negative values (min {x.min().item():g}); accepted: absmaxes >= 0")
