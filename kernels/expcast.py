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
"""E4M3 0x78 = 256.0 = 2^8: the common factor every probability carries."""

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


def anchored_encode(raw: torch.Tensor, coef: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
    """Codes as the kernel forms them: ``clamp(rne(fp32(raw * coef' + anchor') / 2^-24), 0, 120)``.

    ``coef' = fp32(coef * 2^-24)`` and ``anchor' = anchor * 2^-24``: the kernel's one FFMA writes the code in
    units of FP16's smallest subnormal, and the FP32 -> FP16 conversion that packs two codes rounds it to an
    integer (RNE) and clips negatives (and -inf, masked keys) to 0. Two roundings, FP32 then FP16: a code can
    differ from the RNE of the exact value where that lies within an FP32 ulp of a half code. The FMA is
    emulated in float64 (the FP32 product is exact there) and rounded once to FP32.
    """
    unit = torch.tensor(CODE_UNIT, dtype=torch.float32)
    scaled = torch.addcmul((anchor.float() * unit).double(), raw.double(), (coef.float() * unit).double())
    return torch.round(scaled.float().double() / CODE_UNIT).clamp_(0, MAX_CODE).to(torch.uint8)


def row_lse(l: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
    """Each row's natural log-sum-exp of its scaled scores ``tau q . k`` from its sums ``l`` on its final ``anchor``:
    ``fp32(fp32(log2(l) + (LSE_CODE_OFFSET - anchor) / 8) * LN2)``, the kernel's FP32 steps (the division by 8
    exact, ``log2`` its MUFU lg2 there)."""
    octaves = torch.log2(l.float()) + (torch.tensor(LSE_CODE_OFFSET, dtype=torch.float32) - anchor) * LOG2_PER_CODE
    return octaves * torch.tensor(LN2, dtype=torch.float32)


def code_anchor(m: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The integer code offset of a row whose running max is ``m`` and codes-per-score is ``s``.

    ``rne(119.65 - s * m)`` in FP32. Anchoring the code grid to an integer lets one FFMA scale and the FP16
    conversion round each code (``anchored_encode``); the reference point moves by less than half a code from
    ``m``, so the row's top score encodes to 119 or 120 and never saturates.
    """
    bias = torch.tensor(EXPCAST_BIAS, dtype=torch.float32)
    return torch.round(bias - (s * m))
