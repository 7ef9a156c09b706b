"""Rotary position embedding of Q and K, as diffusers' Wan attention (``WanAttnProcessor``) applies it: the
reference, and one launch on Hopper (``sm90.rotary.RotaryQK``) with the same bits.

diffusers computes it with about ten PyTorch kernels per tensor, most of them writing FP32 intermediates; the
launch reads Q, K and the tables once and writes Q and K once. Compiled once per input dtype (``compile_cache``),
shapes and strides symbolic, no GPU needed.
"""

import functools
import logging

import torch

from .compile_cache import load_or_compile
from .support import HEAD_DIM, KernelUnavailableError, kernel_unavailable_reason

logger = logging.getLogger(__name__)

TABLE_ALIGN = 16
"""Bytes: the tables' row stride and base, as the kernel assumes them."""


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` (B, S, H, D) rotated by the FP32 tables ``cos``, ``sin`` (1, S, 1, D): channel pairs (2 i, 2 i + 1) =
    (x1, x2) become (x1 cos[2 i] - x2 sin[2 i + 1], x1 sin[2 i + 1] + x2 cos[2 i]), each product and each sum rounded
    to FP32 on its own (as separate PyTorch kernels round them), then to x's dtype: diffusers' roundings, bit for
    bit."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos_even, sin_odd = cos.unflatten(-1, (-1, 2))[..., 0], sin.unflatten(-1, (-1, 2))[..., 1]
    first = x1 * cos_even - x2 * sin_odd
    second = x1 * sin_odd + x2 * cos_even
    return torch.stack((first, second), dim=-1).flatten(-2).to(x.dtype)


def rotate_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rotary_reference`` of q and of k (B, S, H, D), as new tensors: one launch on the current stream where the
    Hopper kernel takes them (``kernel_rotary_reason``), else the reference."""
    if kernel_rotary_reason(q, k, cos, sin) is not None:
        return rotary_reference(q, cos, sin), rotary_reference(k, cos, sin)
    from .prep_ops import kernel_ready

    q, k = kernel_ready(q), kernel_ready(k)
    q_out, k_out = (torch.empty(q.shape, dtype=q.dtype, device=q.device) for _ in range(2))
    load_rotary(q.dtype)(q, k, kernel_table(cos), kernel_table(sin), q_out, k_out)
    return q_out, k_out


def kernel_rotary_reason(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> str | None:
    """None where ``RotaryQK`` takes these tensors: q and k fp16/bf16 (B, S, H, 128) of one shape and dtype on a
    Hopper GPU, the tables (1, S, 1, 128) FP32 on the same device, and the kernel built; else why not."""
    if q.dim() != 4:
        return f"q has {q.dim()} dims, not (B, S, H, D)"
    reason = kernel_unavailable_reason(q.device, q.dtype, q.shape[-1])
    reason = reason if reason is not None else tables_reason(q, k, cos, sin)
    return reason if reason is not None else rotary_build_failure(q.dtype)


@functools.cache
def rotary_build_failure(dtype: torch.dtype) -> str | None:
    """None once ``RotaryQK`` for ``dtype`` is compiled (or loaded), else why it cannot be (logged once: the
    reference then rotates, as diffusers would, instead of the call failing)."""
    try:
        load_rotary(dtype)
    except KernelUnavailableError as error:
        logger.warning("openvc: the rotary embedding runs its PyTorch reference: %s", error)
        return str(error)
    return None


def tables_reason(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> str | None:
    """None where ``cos`` and ``sin`` are tables the launch applies to (B, S, H, D) q and k: k of q's shape, dtype
    and device, the tables (1, S, 1, 128) FP32 on q's device; else why not."""
    if k.shape != q.shape or k.dtype != q.dtype or k.device != q.device:
        return f"k is {tuple(k.shape)} {k.dtype} on {k.device}, q {tuple(q.shape)} {q.dtype} on {q.device}"
    table = (1, q.shape[1], 1, HEAD_DIM)
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != table or t.dtype != torch.float32 or t.device != q.device:
            return f"{name} is {tuple(t.shape)} {t.dtype} on {t.device}, not {table} torch.float32 on {q.device}"
    return None


def kernel_table(table: torch.Tensor) -> torch.Tensor:
    """A (1, S, 1, 128) table as the kernel's (S, 128): a view where its rows are contiguous and 16-byte aligned,
    else a copy."""
    rows = table[0, :, 0]
    aligned = rows.stride(1) == 1 and rows.stride(0) * 4 % TABLE_ALIGN == 0 and rows.data_ptr() % TABLE_ALIGN == 0
    return rows if aligned else rows.contiguous()


def load_rotary(dtype: torch.dtype):
    """``compile_rotary(dtype)``, compiled once per machine (``compile_cache``)."""
    return load_or_compile(f"rotary_qk_{str(dtype).removeprefix('torch.')}", lambda: compile_rotary(dtype))


def compile_rotary(dtype: torch.dtype):
    """Compile ``RotaryQK`` for fp16 or bf16 Q and K, for sm_90a; no GPU needed."""
    import cutlass.cute as cute

    from .prep_ops import TORCH_TO_CUTLASS, input_fake, table_fake
    from .sm90.rotary import RotaryQK
    from .sm90.target import COMPILE_OPTIONS

    x = [input_fake(TORCH_TO_CUTLASS[dtype]) for _ in range(4)]
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(
        RotaryQK(), x[0], x[1], table_fake(), table_fake(), x[2], x[3], stream, options=COMPILE_OPTIONS
    )
