"""Bit-faithful PyTorch simulation of the Open-VC kernel: the oracle for every kernel test.

It follows the kernel step by step, with the kernel's names (``d_q``, ``d_k``, ``d_v``, ``m``, ``anchor``,
``codes``, ``l``): quantize, then for every 128-row query tile visit the 128-key tiles in mid-window order,
keep the running max on the K-descaled score, encode each score with ExpCast on an integer-anchored code
grid, rescale earlier accumulators whenever the anchor moves, sum the decoded codes into both the
numerator and the denominator, visit V-repair rows last (numerator only), and divide.
All query tiles advance together (one batched matmul per visiting step), so S = 4096 runs in about a second
on two CPU cores. Rounding can differ from the kernel only in FP32 accumulation order and in the MUFU
exponential of the rescale, so codes agree except at rare rounding ties.
"""

import math

import torch

from .expcast import CODES_PER_NAT, anchored_encode, code_anchor, expcast_decode
from .quant import (
    BLOCK,
    choose_repair_tokens,
    gather_tokens,
    num_blocks,
    quantize_per_block,
    quantize_per_head,
    quantize_repair_rows,
    repair_count,
    residual_energy,
    smooth_keys,
    softmax_scale_or_default,
    v_residual,
)
from .validation import check_attention_args
from .wgmma import PV_PROMOTE_EVERY, wgmma_e4m3_dot

ACCUMULATIONS = ("exact", "wgmma")


def visiting_order(n_query_tiles: int, n_key_tiles: int, window: int | None = 4) -> torch.Tensor:
    """Key tiles each query tile visits, in order: ``(n_query_tiles, n_key_tiles)`` int64.

    Mid-window: with diagonal block ``g = min(query tile, n - 1)`` and ``start = min(g + window, n - 1)``,
    visit ``start, ..., 0`` then ``n - 1, ..., start + 1``. Video tokens are in space-time order, so the
    nearby keys that hold the row max come first and later tiles rarely move it. ``window=None``: 0..n-1.
    """
    n = n_key_tiles
    if window is None:
        return torch.arange(n).expand(n_query_tiles, n).clone()
    start = torch.clamp(torch.arange(n_query_tiles) + window, max=n - 1)
    step = torch.arange(n)
    down = start[:, None] - step  # start, start-1, ..., then negative
    return torch.where(down >= 0, down, down + n)


def codes_per_score(softmax_scale: float, d_q: torch.Tensor) -> torch.Tensor:
    """``s``: codes per unit of K-descaled raw score, per query block: ``fp32(fp32(tau * 8 log2 e) * d_q)``."""
    return torch.tensor(softmax_scale * CODES_PER_NAT, dtype=torch.float32) * d_q


def _promote(acc: torch.Tensor, l: torch.Tensor, pv: torch.Tensor, pending: torch.Tensor):
    """The kernel's promotion of the PV wgmma's sum (numerator, and the denominator in its last column) into the
    FP32 sums: ``fma(sum, pending, pv)`` with one rounding (emulated in float64), which applies the anchor moves
    since the last promotion. Returns the new sums and a reset ``pending``."""
    dim = acc.shape[-1]
    acc = (acc.double() * pending[..., None].double() + pv[..., :dim].double()).float()
    l = (l.double() * pending.double() + pv[..., dim].double()).float()
    return acc, l, torch.ones_like(pending)


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    repair_ratio: float = 0.0,
    window: int | None = 4,
    smooth_k: bool = False,
    repair_ranking: str = "energy",
    accumulation: str = "exact",
) -> torch.Tensor:
    """Open-VC attention on ``(B, S, H, D)`` inputs (fp16, bf16 or fp32), BF16 output ``(B, S_q, H, D)``.

    ``softmax_scale`` defaults to ``1 / sqrt(D)``; ``repair_ratio`` is rho of V residual repair (0 = off);
    ``window`` is the mid-window traversal's look-ahead in tiles (``None`` = plain order); ``smooth_k``
    subtracts each head's per-channel mean of K before quantizing (``quant.smooth_keys``);
    ``repair_ranking`` orders repair candidates by residual energy times ``quant.attention_mass``
    ("attention") or by residual energy alone ("energy"); ``accumulation="wgmma"`` adds up Q8 . K8 and P . V8
    (numerator and denominator) as the Hopper kernel's FP8 wgmma does (``wgmma.py``: 14 significant bits, cut
    toward zero; P V summed over ``PV_PROMOTE_EVERY`` tiles before each FP32 add), "exact" in FP32.
    """
    check_attention_args(q, k, v, repair_ratio=repair_ratio, window=window, repair_ranking=repair_ranking)
    if accumulation not in ACCUMULATIONS:
        raise ValueError(f"accumulation must be one of {', '.join(map(repr, ACCUMULATIONS))}, got {accumulation!r}")
    like_wgmma = accumulation == "wgmma"
    dot = wgmma_e4m3_dot if like_wgmma else lambda a, b: a @ b.transpose(-1, -2)
    batch, s_q, heads, dim = q.shape
    s_k = k.shape[1]
    tau = softmax_scale_or_default(softmax_scale, dim)
    n_q, n_k = num_blocks(s_q), num_blocks(s_k)

    q8, d_q = quantize_per_block(q.transpose(1, 2))
    k_heads = k.transpose(1, 2)
    k8, d_k = quantize_per_block(smooth_keys(k_heads) if smooth_k else k_heads)
    v_heads = v.transpose(1, 2)
    v8, d_v = quantize_per_head(v_heads)

    q_tiles = q8.float().view(batch, heads, n_q, BLOCK, dim)
    k_tiles = k8.float().view(batch, heads, n_k, BLOCK, dim)
    v_padded = torch.nn.functional.pad(v8.float(), (0, 0, 0, n_k * BLOCK - s_k))
    v_tiles = v_padded.view(batch, heads, n_k, BLOCK, dim)
    key_valid = (torch.arange(n_k * BLOCK, device=q.device) < s_k).view(n_k, BLOCK)
    s = codes_per_score(tau, d_q)[..., None]  # (B, H, n_q, 1): one per query row

    order = visiting_order(n_q, n_k, window).to(q.device)
    m = torch.full((batch, heads, n_q, BLOCK), -math.inf, device=q.device)
    anchor = None
    acc = torch.zeros(batch, heads, n_q, BLOCK, dim, device=q.device)
    l = torch.zeros(batch, heads, n_q, BLOCK, device=q.device)
    if like_wgmma:
        # The kernel's PV operand: V^T with a ones row (the denominator) for every real key.
        ones = key_valid.float().view(1, 1, n_k, BLOCK, 1).expand(batch, heads, -1, -1, -1)
        v_cols = torch.cat([v_tiles, ones], dim=-1).transpose(-1, -2)  # (B, H, n_k, dim + 1, 128 keys)
        pv = None  # the PV wgmma's running sum over the tiles since the last promotion: (..., dim + 1)
        pending = torch.ones_like(l)  # the anchor moves since the last promotion, not yet applied to acc and l
    for step in range(n_k):
        tile = order[:, step]
        d_k_tile = d_k[:, :, tile]  # (B, H, n_q)
        raw = dot(q_tiles, k_tiles[:, :, tile])  # (B, H, n_q, 128 rows, 128 keys)
        raw.masked_fill_(~key_valid[tile][:, None, :], -math.inf)
        m = torch.maximum(m, raw.amax(dim=-1) * d_k_tile[..., None])
        new_anchor = code_anchor(m, s)
        if anchor is not None:
            alpha = torch.exp2((new_anchor - anchor) * 0.125)
            if like_wgmma:
                pv *= alpha[..., None]
                pending *= alpha
                if step % PV_PROMOTE_EVERY == 0:
                    acc, l, pending = _promote(acc, l, pv, pending)
                    pv = None
            else:
                acc *= alpha[..., None]
                l *= alpha
        anchor = new_anchor
        codes = anchored_encode(raw, (s * d_k_tile[..., None])[..., None], anchor[..., None])
        p = expcast_decode(codes)
        if like_wgmma:
            pv = wgmma_e4m3_dot(p, v_cols[:, :, tile], pv)
        else:
            acc += p @ v_tiles[:, :, tile]
            l += p.sum(dim=-1)
    count = repair_count(s_k, repair_ratio)
    if count > 0:
        residual = v_residual(v_heads, v8, d_v)
        tokens = choose_repair_tokens(residual_energy(residual), count, q, k, ranking=repair_ranking, softmax_scale=tau)
        v_repair = quantize_repair_rows(gather_tokens(residual, tokens), d_v).float()
        k_repair = gather_tokens(k8.float(), tokens)
        d_k_repair = d_k.gather(2, tokens // BLOCK)  # each repair key keeps its own block's scale
        if like_wgmma:
            # As the kernel visits them: after the real keys, in tiles of 128 (zero rows pad the last one, zero V
            # and zero ones add nothing), each tile one more step of the PV chain.
            n_r = num_blocks(count)
            pad = (0, 0, 0, n_r * BLOCK - count)
            k_tiles_r = torch.nn.functional.pad(k_repair, pad).view(batch, heads, n_r, BLOCK, dim)
            v_cols_r = torch.nn.functional.pad(v_repair, (0, 1) + pad[2:]).view(batch, heads, n_r, BLOCK, dim + 1)
            d_k_r = torch.nn.functional.pad(d_k_repair, pad[2:]).view(batch, heads, n_r, BLOCK)
            for j in range(n_r):
                if (n_k + j) % PV_PROMOTE_EVERY == 0:
                    acc, l, pending = _promote(acc, l, pv, pending)
                    pv = None
                raw = dot(q_tiles, k_tiles_r[:, :, j, None].expand(-1, -1, n_q, -1, -1))
                codes = anchored_encode(raw, s[..., None] * d_k_r[:, :, j, None, None, :], anchor[..., None])
                pv = wgmma_e4m3_dot(expcast_decode(codes), v_cols_r[:, :, j, None].transpose(-1, -2), pv)
        else:
            raw = dot(q_tiles, k_repair[:, :, None].expand(-1, -1, n_q, -1, -1))  # (B, H, n_q, 128, count)
            coef = s[..., None] * d_k_repair[:, :, None, None, :]
            codes = anchored_encode(raw, coef, anchor[..., None])
            acc += expcast_decode(codes) @ v_repair[:, :, None]  # numerator only: l keeps the real keys' sum
    if like_wgmma:
        acc, l, _ = _promote(acc, l, pv, pending)

    out = acc * (d_v[..., None, None] / l)[..., None]
    out = out.view(batch, heads, n_q * BLOCK, dim)[:, :, :s_q]
    return out.transpose(1, 2).to(torch.bfloat16)
