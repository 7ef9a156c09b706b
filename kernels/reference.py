"""Bit-faithful PyTorch simulation of the Open-VC kernel: the oracle for every kernel test.

It follows the kernel step by step, with the kernel's names (table below): quantize, then for every 128-row query
tile visit the 128-key tiles in mid-window order, anchor each row's integer code grid to its first tile's max
(K-descaled), encode each score with ExpCast on it, move the anchor down where a tile's codes would pass TOP_CODE
(rescaling the earlier sums), sum the decoded codes into both the numerator and the denominator, visit V-repair
rows last (numerator only), and divide. Query tiles the kernel
splits (``split.py``, given ``sm_count``) run as its pieces do (each keeping the repair keys of the tokens it
visited) and merge as it merges them.
All query tiles advance together (one batched matmul per visiting step), so S = 4096 runs in about a second
on two CPU cores. Rounding can differ from the kernel only in FP32 accumulation order and in the MUFU
exponentials of the rescale and the merge, so codes agree except at rare rounding ties.

Names, reference | kernel (``sm90/fwd.py``, ``sm90/softmax.py``, ``ops.py``) | quantity; ``tests/test_vocabulary.py``
checks that each name is in both sources:

    d_q, d_k, d_v | d_q, d_k, d_v | descales of the Q blocks, K blocks and V heads
    d_k_repair | d_k_repair | each repair key's K descale (its token's block's)
    tile_repair | tile_repair | each repair key's token's key tile (which piece keeps it: ``split.piece_visits``)
    codes_per_dot | codes_per_dot | fp32(tau * 8 log2 e): codes per unit of q . k (``expcast.codes_per_dot``)
    s | s | codes per K-descaled raw score of a query block: fp32(codes_per_dot * d_q)
    raw | scores | a tile's raw FP32 scores Q8 . K8 (the kernel encodes them in place)
    codes | scores | the tile's codes on the row's anchor in units of 2^-24, not yet rounded (``expcast.encode``)
    anchor | anchor | the row's integer code offset: rne(103.65 - s * its first tile's max), lowered by each shift
    shift | shift | how far a tile moves the anchor down: its top code past TOP_CODE onto MOVE_CODE (``code_shift``)
    alpha | alpha | the rescale of the earlier sums where the anchor moves, 2^(-shift LOG2_PER_CODE)
    pv | acc_pv | the PV wgmma's sum since the last promotion (numerator, denominator last)
    pending | pending | the anchor moves not yet applied to the FP32 sums
    acc, l | acc_o, l_column | the FP32 numerator and denominator (column 128 of acc_o in the kernel)
    promote_every | promote_every | key tiles per PV chain (``ForwardConfig.promote_every``)
    steps | visit, first, n_real | a CTA's visiting steps: range(first, first + n_real)
    order | tile_at | the key tile each step visits (mid-window or plain)
    lse, row_lse, LSE_CODE_OFFSET | lse, row_lse, LSE_CODE_OFFSET | a row's log-sum-exp of tau q . k, from l, anchor
"""

import functools
import math
from typing import NamedTuple

import torch

from .expcast import (
    CODE_UNIT,
    LOG2_PER_CODE,
    anchored_encode,
    code_anchor,
    code_shift,
    codes_per_dot,
    encode,
    expcast_decode,
    round_codes,
    row_lse,
)
from .forward_only import forward_only
from .quant import (
    BLOCK,
    num_blocks,
    quantize_inputs,
    smoothing_lse_shift,
    smoothing_mean,
    softmax_scale_or_default,
)
from .repair import gather_tokens, rank_repair_tokens, repair_count, repair_descales, repair_values
from .split import merge_pieces, piece_steps, piece_visits, plan_tail_split
from .validation import check_attention_args, check_flag, check_shared_scales
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


def codes_per_score(codes_per_dot: torch.Tensor, d_q: torch.Tensor) -> torch.Tensor:
    """``s``: codes per unit of K-descaled raw score, per query block: ``fp32(codes_per_dot * d_q)``, as the kernel
    forms it from its ``codes_per_dot`` argument (``expcast.codes_per_dot``)."""
    return codes_per_dot * d_q


def _promote(acc: torch.Tensor, l: torch.Tensor, pv: torch.Tensor, pending: torch.Tensor):
    """The kernel's promotion of the PV wgmma's sum (numerator, and the denominator in its last column) into the
    FP32 sums: ``fma(sum, pending, pv)`` with one rounding (emulated in float64), which applies the anchor moves
    since the last promotion. Returns the new sums and a reset ``pending``."""
    dim = acc.shape[-1]
    acc = (acc.double() * pending[..., None].double() + pv[..., :dim].double()).float()
    l = (l.double() * pending.double() + pv[..., dim].double()).float()
    return acc, l, torch.ones_like(pending)


class _Keys(NamedTuple):
    """The keys of every (batch, head) pair ``bh = batch * heads + head``, as the kernel reads them: E4M3 values
    in FP32, 128-key tiles. ``v`` holds ``(bh, tile, D, 128)`` V^T, with a ones row (the denominator) for every
    real key when summing like the wgmma, else ``(bh, tile, 128, D)``. The repair tiles (``None`` without repair)
    follow the real ones, zero keys padding the last: ``k_repair`` (bh, tile, 128, D), ``d_k_repair`` (bh, tile,
    128: each key keeps its own block's descale), ``tile_repair`` (bh, tile, 128: its token's key tile, 0 for the
    padding), ``v_repair`` laid out as ``v`` with 0 in the ones row."""

    k: torch.Tensor
    d_k: torch.Tensor
    v: torch.Tensor
    valid: torch.Tensor
    k_repair: torch.Tensor | None
    d_k_repair: torch.Tensor | None
    tile_repair: torch.Tensor | None
    v_repair: torch.Tensor | None


def _tiles(x: torch.Tensor, n: int) -> torch.Tensor:
    """``(bh, count, ...)`` -> ``(bh, n, 128, ...)``, zero keys padding the count to ``n`` tiles."""
    pad = [0, 0] * (x.dim() - 2) + [0, n * BLOCK - x.shape[1]]
    return torch.nn.functional.pad(x, pad).view(x.shape[0], n, BLOCK, *x.shape[2:])


def _v_operand(v: torch.Tensor, ones: torch.Tensor | None) -> torch.Tensor:
    """``(bh, n, 128, D)`` V tiles -> the PV operand: with ``ones`` ((n, 128) denominators per key), V^T with
    them as row D (the wgmma-summing form); without, unchanged."""
    if ones is None:
        return v
    ones = ones.float().expand(v.shape[0], -1, -1)[..., None]
    return torch.cat([v, ones], dim=-1).transpose(-1, -2)


def _visit(
    q: torch.Tensor,
    s: torch.Tensor,
    bh: torch.Tensor,
    order: torch.Tensor,
    steps: range,
    keys: _Keys,
    like_wgmma: bool,
    promote_every: int,
    repair: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's loop for units (query tiles) ``q`` (u, 128, D) with codes per score ``s`` (u, 1) and key
    pairs ``bh`` (u,) over the steps ``steps`` of their visiting ``order`` (u, n_k), then, with ``repair`` (the
    keys have repair tiles), the repair tiles on the final anchor (numerator only), keeping the keys whose tokens
    lie in tiles these steps visited (all of them where ``steps`` is the whole order). Returns the unnormalised
    sums ``acc`` (u, 128, D), ``l`` (u, 128) and the final ``anchor`` (u, 128)."""
    dot = wgmma_e4m3_dot if like_wgmma else lambda a, b: a @ b.transpose(-1, -2)
    unit = torch.tensor(CODE_UNIT, dtype=torch.float32)
    anchor = None
    acc = torch.zeros_like(q)
    l = torch.zeros(q.shape[:2], device=q.device)
    pv = None  # wgmma: the PV wgmma's running sum over the tiles since the last promotion, (u, 128, D + 1)
    pending = torch.ones_like(l)  # wgmma: the anchor moves since the last promotion, not yet applied to acc, l
    for j, step in enumerate(steps):  # j counts from the piece's first step: PV chains restart there
        tile = order[:, step]
        d_k_tile = keys.d_k[bh, tile][:, None]  # (u, 1)
        raw = dot(q, keys.k[bh, tile])  # (u, 128 rows, 128 keys)
        raw.masked_fill_(~keys.valid[tile][:, None, :], -math.inf)
        if anchor is None:
            anchor = code_anchor(raw.amax(dim=-1) * d_k_tile, s)
        codes = encode(raw, (s * d_k_tile)[..., None], anchor[..., None])
        if like_wgmma and pv is not None and j % promote_every == 0:
            acc, l, pending = _promote(acc, l, pv, pending)
            pv = None
        shift = code_shift(codes)
        anchor = anchor - shift
        alpha = torch.exp2(-shift * LOG2_PER_CODE)
        if like_wgmma:
            pending *= alpha
            if pv is not None:
                pv *= alpha[..., None]
        else:
            acc *= alpha[..., None]
            l *= alpha
        p = expcast_decode(round_codes(codes - (shift * unit)[..., None]))
        if like_wgmma:
            pv = wgmma_e4m3_dot(p, keys.v[bh, tile], pv)
        else:
            acc += p @ keys.v[bh, tile]
            l += p.sum(dim=-1)
    step_of = order.argsort(dim=1) if repair else None  # (u, n_k): the step at which a unit visits each key tile
    for j in range(keys.k_repair.shape[1] if repair else 0):
        # Each repair tile is one more step of the PV chain; zero keys pad the last (zero V adds nothing).
        if like_wgmma and (len(steps) + j) % promote_every == 0:
            acc, l, pending = _promote(acc, l, pv, pending)
            pv = None
        raw = dot(q, keys.k_repair[bh, j])
        p = expcast_decode(anchored_encode(raw, s[..., None] * keys.d_k_repair[bh, j][:, None, :], anchor[..., None]))
        p = torch.where(piece_visits(step_of.gather(1, keys.tile_repair[bh, j]), steps)[:, None, :], p, 0.0)
        if like_wgmma:
            pv = wgmma_e4m3_dot(p, keys.v_repair[bh, j], pv)
        else:
            acc += p @ keys.v_repair[bh, j]
    if like_wgmma:
        acc, l, _ = _promote(acc, l, pv, pending)
    return acc, l, anchor


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
    sm_count: int | None = None,
    promote_every: int = PV_PROMOTE_EVERY,
    return_lse: bool = False,
    v_absmax: torch.Tensor | None = None,
    k_mean: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Open-VC attention on ``(B, S, H, D)`` inputs (fp16, bf16 or fp32), BF16 output ``(B, S_q, H, D)``.

    ``softmax_scale`` defaults to ``1 / sqrt(D)``; ``repair_ratio`` is rho of V residual repair (0 = off);
    ``window`` is the mid-window traversal's look-ahead in tiles (``None`` = plain order); ``smooth_k``
    subtracts each head's per-channel mean of K (of every 8th key: ``quant.channel_mean``) before quantizing
    (``quant.smoothing_mean``);
    ``repair_ranking`` orders repair candidates by residual energy times ``repair.attention_mass``
    ("attention") or by residual energy alone ("energy"); ``accumulation="wgmma"`` adds up Q8 . K8 and P . V8
    (numerator and denominator) as the Hopper kernel's FP8 wgmma does (``wgmma.py``: 14 significant bits, cut
    toward zero; P V summed over ``promote_every`` tiles before each FP32 add, as ``ForwardConfig.promote_every``
    of the kernel it follows), "exact" in FP32.
    ``sm_count``: the SMs of the GPU the kernel runs on, whose last wave of query tiles it splits
    (``split.py``); None: no split. Forward-only: a backward through the output raises (``forward_only``).

    ``return_lse``: return ``(out, lse)``, lse FP32 ``(B, S_q, H)``: each row's natural log-sum-exp of its scaled
    scores ``tau q . k``, the quantity ``out`` is normalised by (``expcast.row_lse`` of the row's denominator on its
    final anchor; with ``smooth_k`` plus ``quant.smoothing_lse_shift``). ``v_absmax`` (B, H) FP32: V's per-head
    absmax to quantize V with instead of this call's own; ``k_mean`` (B, H, D) FP32, with ``smooth_k``: the mean to
    subtract instead of this call's keys' own. A ring of K/V shards passes the all-shards values, so that every
    shard quantizes as the unsplit call does and the shards' ``(out, lse)`` merge (``merge_attention``) into it.
    """
    check_attention_args(
        q, k, v, repair_ratio=repair_ratio, window=window, repair_ranking=repair_ranking, softmax_scale=softmax_scale
    )
    check_shared_scales(q, k, smooth_k=smooth_k, v_absmax=v_absmax, k_mean=k_mean)
    check_flag("return_lse", return_lse)
    if accumulation not in ACCUMULATIONS:
        raise ValueError(f"accumulation must be one of {', '.join(map(repr, ACCUMULATIONS))}, got {accumulation!r}")
    if sm_count is not None and (isinstance(sm_count, bool) or not isinstance(sm_count, int) or sm_count < 1):
        raise ValueError(f"sm_count must be a positive int or None (no split), got {sm_count!r}")
    if isinstance(promote_every, bool) or not isinstance(promote_every, int) or promote_every < 1:
        raise ValueError(f"promote_every must be a positive int, got {promote_every!r}")
    simulate = functools.partial(
        _simulate,
        softmax_scale=softmax_scale,
        repair_ratio=repair_ratio,
        window=window,
        smooth_k=smooth_k,
        repair_ranking=repair_ranking,
        like_wgmma=accumulation == "wgmma",
        sm_count=sm_count,
        promote_every=promote_every,
        return_lse=return_lse,
        v_absmax=v_absmax,
        k_mean=k_mean,
    )
    return forward_only(simulate, q, k, v)


def _simulate(
    q,
    k,
    v,
    *,
    softmax_scale,
    repair_ratio,
    window,
    smooth_k,
    repair_ranking,
    like_wgmma,
    sm_count,
    promote_every,
    return_lse,
    v_absmax,
    k_mean,
):
    """``reference_attention`` on checked arguments."""
    batch, s_q, heads, dim = q.shape
    s_k = k.shape[1]
    tau = softmax_scale_or_default(softmax_scale, dim)
    n_q, n_k = num_blocks(s_q), num_blocks(s_k)

    mean = smoothing_mean(k, k_mean) if smooth_k else None
    q8, d_q, k8, d_k, v8, d_v = quantize_inputs(
        q, k, v, smooth_k=smooth_k, softmax_scale=tau, v_absmax=v_absmax, k_mean=mean
    )

    pairs = batch * heads
    valid = (torch.arange(n_k * BLOCK, device=q.device) < s_k).view(n_k, BLOCK)
    v_tiles = _tiles(v8.float().reshape(pairs, s_k, dim), n_k)
    repair = [None] * 4
    count = repair_count(s_k, repair_ratio)
    if count > 0:
        # The repair keys of the preparation (``preparation.prepare_reference``), in tiles.
        tokens = rank_repair_tokens(q, k, v, v8, d_v, count, ranking=repair_ranking, softmax_scale=tau)
        v8_rows = gather_tokens(v8.view(torch.uint8), tokens).view(v8.dtype)  # torch gathers no FP8 on the CPU
        v_rows = repair_values(v, v8_rows, tokens, d_v).float().reshape(pairs, count, dim)
        n_r = num_blocks(count)
        repair = [
            _tiles(gather_tokens(k8.float(), tokens).reshape(pairs, count, dim), n_r),
            _tiles(repair_descales(d_k, tokens).reshape(pairs, count), n_r),
            _tiles((tokens // BLOCK).reshape(pairs, count), n_r),
            _v_operand(_tiles(v_rows, n_r), valid.new_zeros(n_r, BLOCK) if like_wgmma else None),
        ]
    keys = _Keys(
        k8.float().view(pairs, n_k, BLOCK, dim),
        d_k.reshape(pairs, n_k),
        _v_operand(v_tiles, valid if like_wgmma else None),
        valid,
        *repair,
    )

    # One unit per query tile of each (batch, head), in the kernel's launch order.
    units = pairs * n_q
    q_units = q8.float().reshape(units, BLOCK, dim)
    s = codes_per_score(codes_per_dot(tau), d_q).reshape(units, 1)
    bh = torch.arange(units, device=q.device) // n_q
    order = visiting_order(n_q, n_k, window).to(q.device).repeat(pairs, 1)
    plan = plan_tail_split(units, n_k, sm_count)
    whole = slice(0, plan.whole_units)
    visit = functools.partial(_visit, keys=keys, like_wgmma=like_wgmma, promote_every=promote_every)
    acc, l, anchor = visit(q_units[whole], s[whole], bh[whole], order[whole], range(n_k), repair=count > 0)
    if plan.splits > 1:
        tail = slice(plan.whole_units, units)
        tail_units = (q_units[tail], s[tail], bh[tail], order[tail])
        pieces = [visit(*tail_units, piece_steps(p, plan.splits, n_k), repair=count > 0) for p in range(plan.splits)]
        acc_tail, l_tail, anchor_tail = merge_pieces(pieces)
        acc, l, anchor = torch.cat([acc, acc_tail]), torch.cat([l, l_tail]), torch.cat([anchor, anchor_tail])

    d_v_unit = d_v.reshape(pairs)[bh, None]
    out = acc * (d_v_unit / l)[..., None]
    out = out.view(batch, heads, n_q * BLOCK, dim)[:, :, :s_q]
    out = out.transpose(1, 2).to(torch.bfloat16)
    if not return_lse:
        return out
    # d_v - d_v: 0, or NaN for a head with a non-finite input (``quant.poison_non_finite``), whose lse is NaN too.
    lse = row_lse(l, anchor) + (d_v_unit - d_v_unit)
    lse = lse.view(batch, heads, n_q * BLOCK)[:, :, :s_q].transpose(1, 2)
    if smooth_k:
        lse = lse + smoothing_lse_shift(q, mean, tau)
    return out, lse
