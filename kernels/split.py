"""Tail split: the key range of the last wave's query tiles, shared out over several CTAs.

The sm90 kernel runs one CTA per unit (a 128-row query tile of one head and batch), one CTA per SM, all units of
equal work. With U units on N SMs the last wave holds only U mod N of them, and the other SMs idle for a whole
unit's time: at 32,760 x 12 (3,072 units on 132 SMs) that wave is 36 units, ~3% of the kernel. The kernel
instead gives each of those last units ``splits`` CTAs (pieces). Piece p visits the steps ``piece_steps(p)`` of
the unit's visiting order with its own anchor (from its first tile), as if they were all the keys, and writes its
unnormalised sums (numerator and denominator, FP32) and its anchors; the last piece of a unit to finish merges
them in piece order:

    anchor = min over pieces of anchor_p           (the highest max)
    sums   = fma(2^((anchor - anchor_p) / 8), sums_p, sums)    for p = 0, 1, ... starting from 0

and divides as an unsplit unit does. ``merge_pieces`` is that merge for the reference. A split unit's output
differs from the unsplit one only in rounding (the codes sit on each piece's grid, not the unit's).
V residual repair keys: every piece visits the repair tiles after its own steps, and keeps the repair keys whose
token lies in a key tile it visited (``piece_visits``), encoded on its own final anchor; the others code 0. A repair
key's score is its token's, so it never tops the max of the piece that visited the token, as in an unsplit unit
(one piece owning every token, on the unit's final anchor).
"""

from typing import NamedTuple

import torch

from .expcast import LOG2_PER_CODE

MIN_STEPS_PER_PIECE = 16
"""Key tiles a piece visits at least: its fixed costs (Q load, pipeline fill, partial write, merge) are about one
tile's time, and a piece shorter than this would gain less than it costs."""
MAX_SPLITS = 8


class TailSplit(NamedTuple):
    """Units ``0 .. whole_units - 1`` run one CTA each; each later unit runs ``splits`` CTAs (its pieces)."""

    units: int
    whole_units: int
    splits: int

    @property
    def split_units(self) -> int:
        return self.units - self.whole_units

    @property
    def ctas(self) -> int:
        return self.whole_units + self.split_units * self.splits


def plan_tail_split(units: int, key_tiles: int, sm_count: int | None) -> TailSplit:
    """The kernel's split for ``units`` CTAs of ``key_tiles`` steps each on ``sm_count`` SMs (None: no split).

    The last wave's ``units mod sm_count`` units take as many pieces each as fill the SMs once, at most
    ``MAX_SPLITS`` and no piece shorter than ``MIN_STEPS_PER_PIECE`` steps.
    """
    tail = units % sm_count if sm_count else 0
    splits = 1
    if tail:
        splits = min(sm_count // tail, key_tiles // MIN_STEPS_PER_PIECE, MAX_SPLITS)
    if splits < 2:
        return TailSplit(units, units, 1)
    return TailSplit(units, units - tail, splits)


def piece_steps(piece: int, splits: int, key_tiles: int) -> range:
    """The visiting steps of piece ``piece`` of ``splits``: consecutive, as even as whole tiles allow."""
    return range(piece * key_tiles // splits, (piece + 1) * key_tiles // splits)


def piece_visits(step: torch.Tensor, steps: range) -> torch.Tensor:
    """Whether the piece of ``steps`` visits the key tiles its unit visits at ``step``: the repair keys of those
    tiles' tokens are its own."""
    return (step >= steps.start) & (step < steps.stop)


def merge_pieces(
    pieces: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's merge of ``(acc (..., D), l (...), anchor (...))`` per piece, in piece order: FP32 sums, each
    step one FMA (emulated in float64 and rounded once) with the factor ``2^((min anchor - anchor_p) / 8)``.
    Returns the merged ``acc``, ``l`` and the anchor they sit on, the lowest (the row's log-sum-exp needs it)."""
    anchor = torch.stack([a for _, _, a in pieces]).amin(dim=0)
    acc = torch.zeros_like(pieces[0][0])
    l = torch.zeros_like(pieces[0][1])
    for acc_p, l_p, anchor_p in pieces:
        factor = torch.exp2((anchor - anchor_p) * LOG2_PER_CODE).double()
        acc = (factor[..., None] * acc_p.double() + acc.double()).float()
        l = (factor * l_p.double() + l.double()).float()
    return acc, l, anchor

