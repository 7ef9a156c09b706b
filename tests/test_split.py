"""The tail split (kernels/split.py): which units split, the pieces' steps, the merge, and the reference with it."""

import math

import pytest
import torch
from helpers import exact_attention
from openvc_diffusers.metrics import rel_l2

from openvc_kernels import reference_attention
from openvc_kernels.reference import visiting_order
from openvc_kernels.split import (
    MAX_SPLITS,
    MIN_STEPS_PER_PIECE,
    TailSplit,
    merge_pieces,
    piece_steps,
    piece_visits,
    plan_tail_split,
)

H200_SMS = 132


@pytest.mark.parametrize(
    "units,key_tiles,expected",
    [
        (3072, 256, TailSplit(3072, 3036, 3)),  # 32,760 x 12: 23.27 waves, the last 36 units in 3 pieces each
        (4018, 574, TailSplit(4018, 3960, 2)),  # 73,397 x 7: 58 units left, 2 pieces fill the SMs
        (23640, 591, TailSplit(23640, 23628, 8)),  # 75,600 x 40: 12 units left, at most MAX_SPLITS pieces
        (264, 256, TailSplit(264, 264, 1)),  # whole waves: nothing to split
        (3072, 31, TailSplit(3072, 3072, 1)),  # pieces of 15 steps would be too short
        (32, 32, TailSplit(32, 0, 2)),  # under one wave: every unit splits
    ],
)
def test_plan(units, key_tiles, expected):
    assert plan_tail_split(units, key_tiles, H200_SMS) == expected


def test_no_split_without_a_gpu():
    assert plan_tail_split(3072, 256, None).splits == 1


@pytest.mark.parametrize("window", [None, 0, 4])
@pytest.mark.parametrize("splits", [2, 3, 8])
def test_each_key_tile_belongs_to_exactly_one_piece(window, splits):
    """Whichever tile a repair key's token is in, one piece of its unit visits that tile: the key counts once."""
    n_k = 8 * MIN_STEPS_PER_PIECE + 5
    step_of = visiting_order(n_k, n_k, window).argsort(dim=1)
    owners = sum(piece_visits(step_of, piece_steps(p, splits, n_k)).int() for p in range(splits))
    assert torch.equal(owners, torch.ones_like(owners))


@pytest.mark.parametrize("sms", [1, 7, 114, 132])
def test_pieces_fill_at_most_one_wave_and_cover_every_step(sms):
    for units in range(1, 400, 7):
        for key_tiles in (1, 16, 33, 257):
            plan = plan_tail_split(units, key_tiles, sms)
            assert plan.split_units * plan.splits <= sms or plan.splits == 1
            assert 1 <= plan.splits <= MAX_SPLITS
            assert plan.ctas == plan.whole_units + plan.split_units * plan.splits
            steps = [s for p in range(plan.splits) for s in piece_steps(p, plan.splits, key_tiles)]
            assert steps == list(range(key_tiles))
            if plan.splits > 1:
                assert min(len(piece_steps(p, plan.splits, key_tiles)) for p in range(plan.splits)) >= (
                    MIN_STEPS_PER_PIECE
                )


def test_merge_brings_pieces_onto_the_lowest_anchor():
    """8 codes apart is one octave: the piece anchored higher (lower max) counts half."""
    acc = [torch.full((1, 2, 3), 4.0), torch.full((1, 2, 3), 6.0)]
    l = [torch.full((1, 2), 1.0), torch.full((1, 2), 3.0)]
    anchor = [torch.tensor([[100.0, 108.0]]), torch.tensor([[108.0, 100.0]])]
    merged_acc, merged_l, _ = merge_pieces(list(zip(acc, l, anchor)))
    assert torch.equal(merged_acc[0, 0], torch.full((3,), 4.0 + 6.0 / 2))
    assert torch.equal(merged_acc[0, 1], torch.full((3,), 4.0 / 2 + 6.0))
    assert torch.equal(merged_l, torch.tensor([[1.0 + 1.5, 0.5 + 3.0]]))


def test_merge_adds_in_piece_order():
    """One FMA per piece from 0, pieces in order: 1 + 2^-24 + 2^-24 rounds to 1 twice, to 1 + 2^-23 otherwise."""
    one, tiny = torch.ones(1, 1, 1), torch.full((1, 1, 1), 2.0**-24)
    anchor, l = torch.zeros(1, 1), torch.ones(1, 1)
    acc, _, _ = merge_pieces([(one, l, anchor), (tiny, l, anchor), (tiny, l, anchor)])
    assert acc.item() == 1.0
    acc, _, _ = merge_pieces([(tiny, l, anchor), (tiny, l, anchor), (one, l, anchor)])
    assert acc.item() == 1.0 + 2.0**-23


@pytest.mark.parametrize("accumulation", ["exact", "wgmma"])
def test_split_reference_is_as_accurate_as_the_unsplit_one(accumulation, fresh_seed):
    """S = 4096 gives 32 units of 32 key tiles per head; on 64 SMs all 32 split in two, on 50 SMs the last 14 of
    64. Each half has its own anchors, so codes move by rounding only: the outputs stay within the codes' noise of
    each other and equally far from float64 attention."""
    # The wgmma model is slow on CPU: one head of 32 channels (its PV chains restart at each piece's first step).
    seq, heads, dim = (4096, 1, 32) if accumulation == "wgmma" else (4096, 2, 128)
    q, k, v = (torch.randn(1, seq, heads, dim).bfloat16() for _ in range(3))
    units = heads * math.ceil(seq / 128)
    sms = 64 if heads == 1 else 50
    assert plan_tail_split(units, 32, sms).splits == 2
    whole = reference_attention(q, k, v, accumulation=accumulation)
    split = reference_attention(q, k, v, accumulation=accumulation, sm_count=sms)
    exact = exact_attention(q, k, v)
    assert not torch.equal(whole, split)
    # Measured (6 seeds, 2026-12-04): 0.85-0.90% apart with exact sums (14 of 64 units split), 1.84-2.03% with wgmma
    # sums (every unit split); errors vs float64 within 1e-4. Before codes could rise to 126 on an anchor (semantics
    # item 4) 0.72-0.76% and 1.58-1.74%: a piece's anchor and the whole unit's now differ by up to 6 codes more.
    assert rel_l2(split, whole) < 0.025, f"seed {fresh_seed}"
    assert abs(rel_l2(split, exact) - rel_l2(whole, exact)) < 2e-3, f"seed {fresh_seed}"
    if accumulation == "exact":  # whole waves: no tail, no split
        assert torch.equal(reference_attention(q, k, v, accumulation=accumulation, sm_count=units), whole)


def test_split_units_keep_what_repair_gains(fresh_seed):
    """V with heavy-tailed token norms, where repair pays: on 64 SMs every unit splits in two, and each piece keeps
    the repair keys of the tokens it visited. The split moves the error against float64 by rounding, as much with
    repair as without. Measured over 4 seeds: the two moves within 0.02 of repair's gain of each other; every
    piece keeping every repair key moves it by 0.8-1.4 gains, the first piece keeping its own alone by 0.4-0.7."""
    q, k, v = (torch.randn(1, 4096, 1, 128) for _ in range(3))
    v *= torch.exp(2.0 * torch.randn(1, 4096, 1, 1))
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    exact = exact_attention(q, k, v)
    error = {
        (rho, sms): rel_l2(reference_attention(q, k, v, repair_ratio=rho, sm_count=sms), exact)
        for rho in (0.0, 0.05)
        for sms in (None, 64)
    }
    gain = error[0.0, None] - error[0.05, None]
    assert gain > 0.003, f"seed {fresh_seed}: {error}"
    split_move = {rho: error[rho, 64] - error[rho, None] for rho in (0.0, 0.05)}
    assert abs(split_move[0.05] - split_move[0.0]) < 0.2 * gain, f"seed {fresh_seed}: {error}"


@pytest.mark.parametrize("sm_count", [0, -1, 1.5, True])
def test_bad_sm_count(sm_count):
    q = torch.randn(1, 10, 1, 128)
    with pytest.raises(ValueError, match="sm_count"):
        reference_attention(q, q, q, sm_count=sm_count)
