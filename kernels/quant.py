"""FP8 E4M3 quantization of attention inputs (PyTorch).

Q and K get one scale per 128-token block, V one scale per head (DESIGN.md section 2):
``a = max(absmax(x), 1e-12)``, ``x8 = e4m3_rne(clamp(x * (448 / a), -448, 448))``, descale ``d = a / 448``.
All tensors here are head-major, ``(B, H, S, D)``; the public entry points take diffusers' ``(B, S, H, D)``.
"""

import math
import struct
from typing import NamedTuple

import torch

from .expcast import CODES_PER_NAT

FP8_MAX = 448.0
BLOCK = 128
"""Tokens per Q/K scale block, and the kernel's query and key tile."""
ABSMAX_FLOOR = 1e-12


def num_blocks(seq_len: int) -> int:
    return -(-seq_len // BLOCK)


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """RNE to E4M3 after clamping: torch's cast turns out-of-range values into NaN, the hardware's saturates."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _scale_and_descale(absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    a = absmax.clamp(min=ABSMAX_FLOOR)
    # One IEEE division each, on every device: with a Python scalar on either side, torch divides by
    # multiplying with a reciprocal (on CUDA also for ``a / 448``), which differs in the last bit.
    fp8_max = torch.full_like(a, FP8_MAX)
    return fp8_max / a, a / fp8_max


def quantize_per_block(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, H, S, D)`` -> FP8 ``(B, H, S_pad, D)`` zero-padded to whole blocks, descales ``(B, H, n_blocks)``;
    both contiguous, whatever the strides of ``x`` (a transposed view of diffusers' layout)."""
    b, h, s, d = x.shape
    n = num_blocks(s)
    padded = torch.nn.functional.pad(x.float(), (0, 0, 0, n * BLOCK - s))
    blocks = padded.view(b, h, n, BLOCK, d)
    scale, descale = _scale_and_descale(blocks.abs().amax(dim=(3, 4)))
    x8 = to_e4m3(blocks * scale[..., None, None]).contiguous().view(b, h, n * BLOCK, d)
    return x8, descale


def quantize_per_head(x: torch.Tensor, absmax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, H, S, D)`` -> FP8 ``(B, H, S, D)`` and descales ``(B, H)``, both contiguous; scaled by ``absmax``
    (B, H) where given (a ring's all-shards V absmax), else by x's own."""
    x = x.float()
    scale, descale = _scale_and_descale(x.abs().amax(dim=(2, 3)) if absmax is None else absmax)
    return to_e4m3(x * scale[..., None, None]).contiguous(), descale


CODE_SPAN_LIMIT = 2.0**24
"""The most codes a score may lie from 0. Up to it, the FP32 anchor ``rne(103.65 - s m)`` and the product ``s m``
keep the row max's code within two codes of 103.65, far under 127 (E4M3's NaN); far past it a row can end with no
code above 0 (l = 0). 2^24 codes are 1.45e6 nats."""


def code_span_quotient(softmax_scale: float, head_dim: int) -> float:
    """``CODE_SPAN_LIMIT / per_descale`` in double, ``per_descale = tau * CODES_PER_NAT * D * 448^2`` the codes per
    unit of ``d_Q d_K``: the code span bound's numerator before its rounding to FP32."""
    return CODE_SPAN_LIMIT / (softmax_scale * CODES_PER_NAT * head_dim * FP8_MAX * FP8_MAX)


def code_span_numerator(softmax_scale: float, head_dim: int) -> float:
    """``code_span_quotient`` rounded once to FP32 (RNE), as the Python float of that FP32 value: the number that
    ``limit_code_span``'s product multiplies by, and the guard kernel's argument (``sm90.guards``)."""
    return struct.unpack("f", struct.pack("f", code_span_quotient(softmax_scale, head_dim)))[0]


def limit_code_span(d_q: torch.Tensor, d_k: torch.Tensor, softmax_scale: float, head_dim: int) -> torch.Tensor:
    """``d_q`` as the codes use it: lowered, per query block, where a score could lie more than
    ``CODE_SPAN_LIMIT`` codes from 0, so that it cannot; ``d_q`` itself (bitwise) everywhere else.

    A score's codes are ``s d_K raw`` with ``s = tau * 8 log2(e) * d_Q`` and ``|raw| <= D * 448^2``; the bound
    uses each head's largest key-block descale. Only d_Q sets ``s`` (the output is ``d_V acc / l``), so lowering
    it scales the scores down, a higher softmax temperature. With ``tau = 1 / sqrt(128)`` that takes absmaxes
    whose product ``a_Q a_K`` exceeds 128,000 (logits that could reach 10^6 nats), where the softmax is one key's.

    In FP32, rounding for rounding on CPU and CUDA (and in ``sm90.guards``): ``d_k_max = amax(d_k)`` (NaN if any is);
    the bound ``reciprocal(d_k_max) * code_span_quotient(...)``, two roundings: an IEEE reciprocal, then one FP32
    product with ``code_span_numerator`` (torch multiplies an FP32 tensor by a Python float in FP32, the float
    rounded to FP32 first; written with the double so that it traces, ``struct`` does not); this is what the
    former ``code_span_quotient / d_k_max`` computed, as torch divides a number by a tensor; then
    ``torch.minimum``, which keeps a NaN of either side (on CUDA that NaN's bits: d_q's where d_q is NaN, else the
    bound's).
    """
    d_k_max = d_k.amax(dim=-1, keepdim=True)
    return torch.minimum(d_q, d_k_max.reciprocal() * code_span_quotient(softmax_scale, head_dim))


def poison_non_finite(d_q: torch.Tensor, d_k: torch.Tensor, d_v: torch.Tensor) -> torch.Tensor:
    """``d_v`` (B, H), NaN for each (batch, head) whose Q, K or V holds an inf or NaN (its absmax, hence its
    descale, is then not finite): that head's whole output is NaN, as documented, whatever the kernel's
    arithmetic does with the non-finite bytes."""
    finite = torch.isfinite(d_q).all(dim=-1) & torch.isfinite(d_k).all(dim=-1) & torch.isfinite(d_v)
    return d_v.masked_fill(~finite, math.nan)


class Quantized(NamedTuple):
    """Q, K and V in FP8 (head-major, contiguous) with the descales the kernel reads: ``d_q`` (B, H, n_q) after
    ``limit_code_span``, ``d_k`` (B, H, n_k), ``d_v`` (B, H) after ``poison_non_finite``."""

    q8: torch.Tensor
    d_q: torch.Tensor
    k8: torch.Tensor
    d_k: torch.Tensor
    v8: torch.Tensor
    d_v: torch.Tensor


def quantize_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    smooth_k: bool,
    softmax_scale: float,
    v_absmax: torch.Tensor | None = None,
    k_mean: torch.Tensor | None = None,
) -> Quantized:
    """The kernel's quantization of ``(B, S, H, D)`` q, k, v: Q and K per block (K minus ``smoothing_mean(k,
    k_mean)`` with ``smooth_k``), V per head (by ``v_absmax`` (B, H) where given), and the descale guards. The
    reference and the PyTorch preparation both start here; the fused preparation writes the same bytes and applies
    the same guards (``apply_descale_guards``)."""
    q8, d_q = quantize_per_block(q.transpose(1, 2))
    k_heads = k.transpose(1, 2)
    if smooth_k:
        k_heads = k_heads.float() - smoothing_mean(k, k_mean)[:, :, None]
    k8, d_k = quantize_per_block(k_heads)
    v8, d_v = quantize_per_head(v.transpose(1, 2), v_absmax)
    d_q, d_v = apply_descale_guards(d_q, d_k, d_v, softmax_scale, head_dim=q.shape[-1])
    return Quantized(q8, d_q, k8, d_k, v8, d_v)


def apply_descale_guards(
    d_q: torch.Tensor, d_k: torch.Tensor, d_v: torch.Tensor, softmax_scale: float, *, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``limit_code_span(d_q)`` and ``poison_non_finite(d_v)``, from the descales as quantization wrote them."""
    return limit_code_span(d_q, d_k, softmax_scale, head_dim), poison_non_finite(d_q, d_k, d_v)


BLOCK_SUM_ORDER = (4, 8, 4)
"""How a 128-token block of K is summed per channel (``channel_block_sums``, the fused preparation's order):
(passes, warps, rows), token = 32 pass + 4 warp + row. The 4 passes of a (warp, row) are added in order, then the
4 rows of a warp pairwise, (0 + 1) + (2 + 3), then the 8 warps in order."""
MEAN_TOKEN_STRIDE = 8
"""``channel_mean`` reads every 8th key (tokens 0, 8, 16, ...): any vector subtracted leaves softmax unchanged in
exact math, and an even eighth of the keys estimates the channel offsets that smoothing removes as well as all of
them (``notes/accuracy.md``), for an eighth of the reads."""
MEAN_SEGMENTS = 8
"""``channel_mean`` adds a head's block sums in this many consecutive segments, each in order from 0, then the
segments in order."""


def mean_tokens(seq_len: int) -> int:
    """How many keys of a sequence of ``seq_len`` ``channel_mean`` reads (every ``MEAN_TOKEN_STRIDE``-th)."""
    return -(-seq_len // MEAN_TOKEN_STRIDE)


def mean_keys(k: torch.Tensor, start: int = 0) -> torch.Tensor:
    """The keys of ``(B, S, H, D)`` k that ``channel_mean`` of the whole sequence reads, where k is the shard of it
    from token ``start`` on (a ring's): a strided view, no copy."""
    return k[:, -start % MEAN_TOKEN_STRIDE :: MEAN_TOKEN_STRIDE]


def channel_block_sums(k: torch.Tensor) -> torch.Tensor:
    """Each 128-token block's per-channel FP32 sums of the keys of ``(B, S, H, D)`` K that ``channel_mean`` reads
    (every ``MEAN_TOKEN_STRIDE``-th; the others and the padding to whole blocks count as +0), added in
    ``BLOCK_SUM_ORDER``: ``(B, H, n_blocks, D)``."""
    batch, seq_len, heads, dim = k.shape
    n = num_blocks(seq_len)
    passes, warps, rows = BLOCK_SUM_ORDER
    x = k.new_zeros(batch, n * BLOCK, heads, dim, dtype=torch.float32)
    x[:, :seq_len:MEAN_TOKEN_STRIDE] = mean_keys(k)
    x = x.view(batch, n, passes, warps, rows, heads, dim)
    s = x[:, :, 0]
    for p in range(1, passes):
        s = s + x[:, :, p]
    while s.shape[3] > 1:  # rows r and r ^ 1, then pairs of pairs: the kernel's butterfly over a warp's rows
        s = s[:, :, :, 0::2] + s[:, :, :, 1::2]
    total = s[:, :, 0, 0]
    for w in range(1, warps):
        total = total + s[:, :, w, 0]
    return total.permute(0, 2, 1, 3)


def channel_mean(k: torch.Tensor) -> torch.Tensor:
    """Each head's per-channel mean of every ``MEAN_TOKEN_STRIDE``-th key of ``(B, S, H, D)`` K, summed in FP32 in
    a defined order, whatever K's layout or device: ``(B, H, D)``.

    The block sums (``channel_block_sums``) added in ``MEAN_SEGMENTS`` consecutive segments, then one IEEE
    division by the keys' count (``mean_tokens``): the fused preparation's two launches
    (``sm90.prep.ChannelSumsPerBlock`` or ``AbsmaxAndChannelSums``, then ``ChannelMean``) compute the same bits.
    """
    sums = channel_block_sums(k)
    n = sums.shape[2]
    total = None
    for j in range(MEAN_SEGMENTS):
        part = torch.zeros_like(sums[:, :, 0])
        for i in range(j * n // MEAN_SEGMENTS, (j + 1) * n // MEAN_SEGMENTS):
            part = part + sums[:, :, i]
        total = part if total is None else total + part
    # A full tensor divisor: with a scalar torch may multiply by its reciprocal (see _scale_and_descale).
    return total / torch.full_like(total, mean_tokens(k.shape[1]))


def smoothing_mean(k: torch.Tensor, k_mean: torch.Tensor | None = None) -> torch.Tensor:
    """The per-channel mean K smoothing subtracts from ``(B, S, H, D)`` k: ``k_mean`` (B, H, D) where given (a ring's
    all-keys mean), else this call's ``channel_mean``: ``(B, H, D)`` FP32.

    Every score of a query row moves by the same ``q . mean``, so softmax is unchanged in exact math, while
    the per-block K scales stop being set by channel offsets that video DiTs carry.
    """
    return k_mean if k_mean is not None else channel_mean(k)


def smoothing_lse_shift(q: torch.Tensor, mean: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """``tau * (q . mean)`` in FP32 per row of ``(B, S_q, H, D)`` q: ``(B, S_q, H)``. Smoothing took it off every score
    of the row (``mean``: the ``smoothing_mean`` subtracted), so adding it to the row's log-sum-exp gives that of the
    true scaled scores ``tau q . k``. The reference and the kernel's host side both add it here."""
    return torch.einsum("bshd,bhd->bsh", q.float(), mean) * softmax_scale


def softmax_scale_or_default(softmax_scale: float | None, head_dim: int) -> float:
    """``softmax_scale``, or the usual ``1 / sqrt(head_dim)`` where it is None."""
    return softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
