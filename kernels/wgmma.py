"""How Hopper's FP8 wgmma adds up a dot product, in PyTorch, so the reference can follow the kernel's QK^T.

Model (Microsoft's MMA-Sim, arXiv 2511.10909; notes/fp8_accumulation.md): one E4M3 ``k32`` instruction sums its
32 exact products and the incoming FP32 accumulator C as one fused sum. Every term is aligned to the largest
exponent among them (C included), cut toward zero to ``FRACTION_BITS`` bits below it, the cut terms are added
exactly, and the sum is cut toward zero to an FP32 with ``FRACTION_BITS`` fraction bits (the low 10 zero). A
head-dim-128 dot product chains 4 such instructions in k order. Exact FP32 summation differs from it by enough
to move a few ExpCast codes by one (measured: notes/kernel.md, notes/fp8_accumulation.md).

The same holds for P V: the kernel's PV wgmma chains ``PV_PROMOTE_EVERY`` key tiles (4 instructions each)
before it adds that sum into FP32 registers, and the 14-bit sums drop the small products of each chain.
"""

import torch

K_BLOCK = 32
"""Products per FP8 wgmma instruction (m64nNk32)."""
FRACTION_BITS = 13
"""Fraction bits an FP8 wgmma keeps: 14 significant bits, as DeepSeek-V3 reports."""
E4M3_MIN_EXPONENT = -6
"""E4M3 subnormals share the exponent of the smallest normal, 2^-6."""
ZERO_EXPONENT = -126
MIN_ALIGN_EXPONENT = -100
LOW_BITS_MASK = ~((1 << (23 - FRACTION_BITS)) - 1)
PV_PROMOTE_EVERY = 8
"""Key tiles the sm90 kernel's PV wgmma adds up before its sum moves into FP32 registers: the default of
``sm90.config.ForwardConfig.promote_every``, which the reference models. Why 8 (half the promotions' FFMAs; the
longer chains cost accuracy only where attention is near-uniform): notes/kernel.md, 2026-12-05."""


def _exponent(x: torch.Tensor) -> torch.Tensor:
    """floor(log2 |x|) as an integer; zeros take the smallest FP32 normal exponent."""
    e = torch.frexp(x)[1] - 1
    return torch.where(x == 0, torch.full_like(e, ZERO_EXPONENT), e)


def _e4m3_exponent(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x != 0, _exponent(x).clamp(min=E4M3_MIN_EXPONENT), _exponent(x))


def _k32_step(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """One instruction: ``a (..., M, 32) . b (..., N, 32)^T + c (..., M, N)``, a and b E4M3 values in FP32."""
    product_exponent = _e4m3_exponent(a)[..., :, None, :] + _e4m3_exponent(b)[..., None, :, :]
    # Clamped so that 2^shift stays finite (ldexp multiplies by it: 0 * inf would be NaN for all-zero terms);
    # nonzero E4M3 products are >= 2^-18, so the clamp never moves a bit that matters.
    e_max = torch.maximum(product_exponent.amax(dim=-1), _exponent(c)).clamp(min=MIN_ALIGN_EXPONENT)
    shift = FRACTION_BITS - e_max
    products = a[..., :, None, :] * b[..., None, :, :]  # exact: 8 significant bits
    # Aligned and cut toward zero, every term is an integer below 2^15: their sum is exact in FP32.
    total = torch.trunc(torch.ldexp(products, shift[..., None].float())).sum(dim=-1)
    total = total + torch.trunc(torch.ldexp(c, shift.float()))
    out = torch.ldexp(total, -shift.float())
    return (out.view(torch.int32) & LOW_BITS_MASK).view(torch.float32)  # cut toward zero to 13 fraction bits


def wgmma_e4m3_dot(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None = None) -> torch.Tensor:
    """``a (..., M, D) @ b (..., N, D)^T + c`` as chained FP8 wgmma k32 instructions add it up, k in order.

    ``a`` and ``b`` hold E4M3 values (any float dtype); D a multiple of 32. Without ``c`` the first instruction
    starts from C = +0, as the kernel's does (its scale-d predicate off).
    """
    a, b = a.float(), b.float()
    acc = a.new_zeros(*a.shape[:-1], b.shape[-2]) if c is None else c
    for k in range(0, a.shape[-1], K_BLOCK):
        acc = _k32_step(a[..., k : k + K_BLOCK], b[..., k : k + K_BLOCK], acc)
    return acc
