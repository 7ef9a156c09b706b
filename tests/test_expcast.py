import pytest
import torch

from openvc_kernels import expcast_decode, expcast_encode
from openvc_kernels.expcast import (
    CODE_UNIT,
    MAX_CODE,
    MOVE_CODE,
    TOP_CODE,
    anchored_encode,
    code_anchor,
    code_shift,
    encode,
    round_codes,
)


def exp_then_cast(z: torch.Tensor) -> torch.Tensor:
    return (torch.exp2(z.double()) * 256).to(torch.float8_e4m3fn).view(torch.uint8)


AGREEING_SHARE = 0.7961
"""The share of z in [-14, 0] whose ExpCast code is exp-then-cast's (on an even grid of 20M points)."""


def test_matches_exp_then_cast_on_the_normal_range(fresh_seed):
    # z in [-14, 0]: the probabilities 2^z * 256 span E4M3's normal codes 8..120.
    z = torch.rand(2_000_000) * -14.0
    codes, exact = expcast_encode(z), exp_then_cast(z)
    agree = (codes == exact).float().mean().item()
    # 2M uniform draws spread the share by 0.00029 (one sigma): 5 sigma.
    assert abs(agree - AGREEING_SHARE) <= 5 * 0.00029, f"seed {fresh_seed}: {agree:.4f} of codes agree"
    assert (codes.int() - exact.int()).abs().max().item() == 1


def test_decode_of_the_extremes():
    codes = torch.tensor([0, 8, 56, MAX_CODE], dtype=torch.uint8)
    assert expcast_decode(codes).tolist() == [0.0, 2.0**-6, 1.0, 256.0]
    assert expcast_encode(torch.tensor([0.0, 0.2, -100.0])).tolist() == [120, 120, 0]


def test_decode_rejects_non_byte_codes():
    with pytest.raises(ValueError, match="uint8"):
        expcast_decode(torch.zeros(3, dtype=torch.int32))


def test_anchored_code_of_the_row_max_is_103_or_104(fresh_seed):
    s = torch.rand(10_000) * 4 + 0.1
    m = torch.randn(10_000) * 30
    raw_max, coef = m.clone(), s  # d_k = 1: the raw max is the max
    codes = anchored_encode(raw_max, coef, code_anchor(m, s))
    assert set(codes.unique().tolist()) <= {103, 104}, f"seed {fresh_seed}"


def test_anchored_encode_clips_masked_scores_to_zero():
    codes = anchored_encode(torch.tensor([-float("inf"), -1e9]), torch.tensor(1.0), torch.tensor(100.0))
    assert codes.tolist() == [0, 0]


def test_anchored_encode_is_the_fp16_word_of_the_ffma(fresh_seed):
    """The kernel's code is the FP16 word of ``fp32(raw * coef' + anchor')`` (units of 2^-24), clipped at 0."""
    raw = torch.randn(200_000) * 1e4
    coef = torch.rand(200_000) * 1e-3
    anchor = torch.round(torch.rand(200_000) * 140 - raw * coef)
    unit = torch.tensor(CODE_UNIT)
    ffma = torch.addcmul((anchor * unit).double(), raw.double(), (coef * unit).double()).float()
    words = ffma.half().view(torch.int16).int()
    assert torch.equal(encode(raw, coef, anchor), ffma)
    expected = torch.where(ffma > 0, words, 0)
    # Clipped at TOP_CODE (a repair tile's zero keys, where a row's scores are all negative).
    assert torch.equal(anchored_encode(raw, coef, anchor).int(), expected.clamp(max=TOP_CODE)), f"seed {fresh_seed}"
    assert 0 < (expected == 0).sum() and (expected > TOP_CODE).any() and (expected <= TOP_CODE).float().mean() > 0.8


def test_anchored_encode_rounds_twice():
    """raw * coef + anchor = 100.5 + 2^-23 + 2^-47: FP32 keeps 100.5, whose RNE is 100 (one rounding: 101)."""
    raw, coef = torch.tensor(1 + 2.0**-23), torch.tensor(0.5 + 2.0**-24)
    assert anchored_encode(raw, coef, torch.tensor(100.0)).item() == 100


def test_round_codes_clip_at_the_top_code():
    """E4M3 has no finite byte above 126 (127 is NaN): codes past it are clipped, as the kernel clips a repair
    tile's with fmin before rounding (the same integer either way)."""
    y = torch.tensor([126.49, 126.5, 126.51, 127.0, 1e6]) * CODE_UNIT
    assert round_codes(y).tolist() == [TOP_CODE] * 5
    assert torch.equal(round_codes(y), round_codes(torch.minimum(y, torch.tensor(TOP_CODE * CODE_UNIT))))


@pytest.mark.parametrize(
    "top, shift",
    [
        (100.0, 0), (120.0, 0), (126.0, 0), (126.5, 0), (126.6, 15), (127.0, 15), (127.5, 16), (300.2, 188),
        (300.7, 189), (2.0**20, 2**20 - 112),
    ],
)
def test_code_shift_moves_a_row_only_past_the_top_code(top, shift):
    """A row's anchor stays while its top code (the RNE of the largest value, 126.5 rounding to 126) is at most
    TOP_CODE; past it, it moves by that code less MOVE_CODE, so that the top code is 112."""
    y = torch.tensor([[top, top - 3.0, -5.0, -float("inf")]]) * CODE_UNIT
    assert code_shift(y).tolist() == [shift]
    top_code = round_codes(y - code_shift(y)[:, None] * CODE_UNIT)[0, 0].item()
    assert top_code == (MOVE_CODE if shift else round(top))


def test_a_shift_is_exact_for_every_code_above_zero(fresh_seed):
    """``y - shift * 2^-24`` in FP32 equals the exact difference wherever it codes above 0 (so the reference's and the
    kernel's FP32 subtraction need no model of a rounding)."""
    y = (torch.rand(100_000, 128) * 2.0 ** torch.randint(-4, 20, (100_000, 1)) - 3.0) * CODE_UNIT
    shift = code_shift(y)
    shifted = y - shift[:, None] * CODE_UNIT
    exact = y.double() - shift[:, None].double() * CODE_UNIT
    coded = exact > 0.5 * CODE_UNIT
    assert (shift > 0).float().mean() > 0.4, f"seed {fresh_seed}"  # exponents 8..19 of -4..19 shift
    assert torch.equal(shifted.double()[coded], exact[coded]), f"seed {fresh_seed}"
