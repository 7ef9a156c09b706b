"""ExpCast: the E4M3 byte of a softmax probability, straight from its log2.

An E4M3 byte read as an integer is close to ``8 * log2(value) + 56``. With every probability carrying a
common factor 2^8 (which cancels in the softmax division), the byte of ``2^z * 256`` is
``clamp(rne(8 z + 119.65), 0, 120)``: 119.65 = 64 + 56 + beta with beta = -0.35 centring the error.
On the normal range (z in [-14, 0]) this equals exp-then-cast (RNE) for 79.6% of z and is never more
than one code off. Code 120 is 0x78 = 256.0; code 0 is 0.0.
"""

import math

import torch

EXPCAST_BIAS = 119.65
"""64 + 56 + beta, beta = -0.35: the code of z = 0 before rounding."""

MAX_CODE = 120
"""E4M3 0x78 = 256.0 = 2^8: the common factor every probability carries (``expcast_encode``'s top code)."""

FIRST_ANCHOR_BIAS = EXPCAST_BIAS - 16
"""103.65, two octaves under ExpCast's 119.65: where a row's first anchor is set (``code_anchor``), its top score
encodes to 103 or 104. The first key tile holds 128 of the row's keys, and a later one's max usually passes theirs:
the 22 codes (1.9 nats) of headroom under TOP_CODE leave most rows of N(0, 1) scores with no move at all, where 6
moved nearly every row once (notes/kernel.md has the rates and the error), for two octaves of the smallest
probabilities of the rows that never move."""

MOVE_CODE = 112
"""Where a row's anchor moves, its top code lands (``code_shift``): the anchor moves by a whole number of codes, so
every code of the row keeps its rounding (``rne(y - n) = rne(y) - n``) and the top one becomes 112: 14 codes (1.2
nats) of headroom before the next move. A move comes from a tile past the first, with the row's max known better, and
keeps an octave more of the row's smallest probabilities than a first anchor does."""

TOP_CODE = 126
"""E4M3 0x7E = 448.0, the largest finite byte (0x7F is NaN): the highest code a row's scores take on its anchor. A
key tile whose codes would pass it moves the anchor (``code_shift``); codes 121..126 are ExpCast's as any other
(the same step per code), so a new row max within 22 codes of a first anchor's top (14 of a moved one's) costs no
move and no rescale."""

CODES_PER_NAT = 8.0 * math.log2(math.e)
"""Codes per unit of natural-log score: 8 codes per octave times log2(e)."""

LOG2_PER_CODE = 0.125
"""One code step is 1/8 octave: moving a row's anchor by k codes scales its probabilities (and sums) by 2^(k/8)."""

LSE_CODE_OFFSET = EXPCAST_BIAS - 8 * 8
"""119.65 - 64: ExpCast encodes ``2^z * 256`` so that a real code c decodes, on average over the code grid, to about
``2^((c - LSE_CODE_OFFSET) / 8)`` (8 codes per octave, the 2^8 factor taken out): a row's sum ``l`` on anchor ``a`` is
about ``sum_j exp(tau q . k_j) * 2^((a - LSE_CODE_OFFSET) / 8)``. Beta is included: with 56, the code of 1.0, the
log-sum-exp would come out 0.35 codes (0.03 nats) high."""

LN2 = math.log(2.0)
"""ln 2: the log-sum-exp is formed in octaves (the kernel's log2) and turned into nats once."""

CODE_UNIT = 2.0**-24
"""FP16's smallest subnormal. The kernel's FFMA writes a code c as c * 2^-24; converting that to FP16 rounds it to
the subnormal grid (the RNE of the code) and leaves c as the FP16 word, so its low byte is the E4M3 byte."""


def codes_per_dot(softmax_scale: float) -> torch.Tensor:
    """Codes per unit of the dot product ``q . k``: ``fp32(tau * 8 log2 e)`` (a 0-d tensor, so that the reference
    traces under torch.compile without a graph break), the kernel's argument; times a query block's descale it is
    that block's codes per score ``s``."""
    return torch.tensor(softmax_scale * CODES_PER_NAT, dtype=torch.float32)


def expcast_encode(z: torch.Tensor) -> torch.Tensor:
    """E4M3 bytes (uint8) of ``2^z * 256`` by ExpCast: ``clamp(rne(8 z + 119.65), 0, 120)``.

    ``z`` is the log2 of the probability relative to the running max (z <= 0); computed in FP32.
    """
    codes = torch.round(z.float() * 8.0 + torch.tensor(EXPCAST_BIAS, dtype=torch.float32))
    return codes.clamp_(0, MAX_CODE).to(torch.uint8)


def expcast_decode(codes: torch.Tensor) -> torch.Tensor:
    """FP32 values of E4M3 bytes (the bytes reinterpreted, not converted)."""
    if codes.dtype != torch.uint8:
        raise ValueError(f"expcast_decode takes uint8 codes, got {codes.dtype}")
    return codes.view(torch.float8_e4m3fn).float()


def encode(raw: torch.Tensor, coef: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
    """The kernel's FFMA: ``fp32(raw * coef' + anchor')``, each score's code in units of 2^-24 before rounding.

    ``coef' = fp32(coef * 2^-24)`` and ``anchor' = anchor * 2^-24``: the code in units of FP16's smallest subnormal,
    which the FP32 -> FP16 conversion that packs two codes rounds to an integer (``round_codes``). The FMA is
    emulated in float64 (the FP32 product is exact there) and rounded once to FP32.
    """
    unit = torch.tensor(CODE_UNIT, dtype=torch.float32)
    return torch.addcmul((anchor.float() * unit).double(), raw.double(), (coef.float() * unit).double()).float()


def round_codes(y: torch.Tensor) -> torch.Tensor:
    """``encode``'s FP32 values -> codes (uint8): the RNE of ``y / 2^-24``, negatives (and -inf, masked keys) 0, as
    ``cvt.rn.relu.f16x2.f32`` leaves them in the low byte of a half. Two roundings, FP32 then FP16: a code can
    differ from the RNE of the exact value where that lies within an FP32 ulp of a half code. Clipped at TOP_CODE:
    a real tile's codes never get there (its anchor moves first, ``code_shift``); a repair tile's do, as the kernel
    clips them (``anchored_encode``)."""
    return torch.round(y.double() / CODE_UNIT).clamp_(0, TOP_CODE).to(torch.uint8)


def anchored_encode(raw: torch.Tensor, coef: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
    """Codes on a row's final anchor, as the kernel forms a repair tile's: ``round_codes`` of ``encode`` (the clip
    at TOP_CODE, the kernel's ``fmin`` before its rounding, the same integer: a zero key padding the last repair
    tile scores 0, which a row whose scores are all negative would code above it)."""
    return round_codes(encode(raw, coef, anchor))


def code_shift(y: torch.Tensor) -> torch.Tensor:
    """How far each row's anchor moves down for a key tile encoded on it (``y``: (..., keys), ``encode``'s values):
    where the row's top code ``rne(max(y) / 2^-24)`` passes TOP_CODE, by that code less MOVE_CODE, so that the top
    code becomes 112, else 0. The row's codes are then ``y - shift * 2^-24`` (FP32: exact for every value that codes
    above 0, which is larger than the shift), its sums rescaled by ``2^(-shift / 8)``. FP32 throughout (the division
    by 2^-24 exact); integers. (The kernel reads the top code off its packed FP16 codes, which hold it exactly below
    2048, and takes the FP32 max above.)"""
    top = torch.round(y.amax(dim=-1) / torch.tensor(CODE_UNIT, dtype=torch.float32))
    return torch.where(top > TOP_CODE, top - MOVE_CODE, 0.0)


def row_lse(l: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
    """Each row's natural log-sum-exp of its scaled scores ``tau q . k`` from its sums ``l`` on its final ``anchor``:
    ``fp32(fp32(log2(l) + (LSE_CODE_OFFSET - anchor) / 8) * LN2)``, the kernel's FP32 steps (the division by 8
    exact, ``log2`` its MUFU lg2 there)."""
    octaves = torch.log2(l.float()) + (torch.tensor(LSE_CODE_OFFSET, dtype=torch.float32) - anchor) * LOG2_PER_CODE
    return octaves * torch.tensor(LN2, dtype=torch.float32)


def code_anchor(m: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The integer code offset of a row whose first key tile's max is ``m`` and codes-per-score is ``s``.

    ``rne(103.65 - s * m)`` in FP32 (``FIRST_ANCHOR_BIAS``): a row's first anchor, from its first key tile's max.
    Anchoring the code grid to an integer lets one FFMA scale and the FP16 conversion round each code (``encode``,
    ``round_codes``); the reference point moves by less than half a code from ``m``, so the row's top score encodes
    to 103 or 104.
    """
    bias = torch.tensor(FIRST_ANCHOR_BIAS, dtype=torch.float32)
    return torch.round(bias - (s * m))
