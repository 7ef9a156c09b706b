import pytest
import torch

from openvc_kernels import expcast_decode, expcast_encode
from openvc_kernels.expcast import CODE_UNIT, MAX_CODE, anchored_encode, code_anchor


def exp_then_cast(z: torch.Tensor) -> torch.Tensor:
    return (torch.exp2(z.double()) * 256).to(torch.float8_e4m3fn).view(torch.uint8)


def test_matches_exp_then_cast_on_the_normal_range(fresh_seed):
    # z in [-14, 0]: the probabilities 2^z * 256 span E4M3's normal codes 8..120.
    z = torch.rand(2_000_000) * -14.0
    codes, exact = expcast_encode(z), exp_then_cast(z)
    agree = (codes == exact).float().mean().item()
    assert abs(agree - 0.796) <= 0.001, f"seed {fresh_seed}: {agree:.4f} of codes agree"
    assert (codes.int() - exact.int()).abs().max().item() == 1


def test_decode_of_the_extremes():
    codes = torch.tensor([0, 8, 56, MAX_CODE], dtype=torch.uint8)
    assert expcast_decode(codes).tolist() == [0.0, 2.0**-6, 1.0, 256.0]
    assert expcast_encode(torch.tensor([0.0, 0.2, -100.0])).tolist() == [120, 120, 0]


def test_decode_rejects_non_byte_codes():
    with pytest.raises(ValueError, match="uint8"):
        expcast_decode(torch.zeros(3, dtype=torch.int32))


def test_anchored_code_of_the_row_max_is_119_or_120(fresh_seed):
    s = torch.rand(10_000) * 4 + 0.1
    m = torch.randn(10_000) * 30
    raw_max, coef = m.clone(), s  # d_k = 1: the raw max is the max
    codes = anchored_encode(raw_max, coef, code_anchor(m, s))
    assert set(codes.unique().tolist()) <= {119, 120}, f"seed {fresh_seed}"


def test_anchored_encode_clips_masked_scores_to_zero():
    codes = anchored_encode(torch.tensor([-float("inf"), -1e9]), torch.tensor(1.0), torch.tensor(100.0))
    assert codes.tolist() == [0, 0]


def test_anchored_encode_is_the_fp16_word_of_the_ffma(fresh_seed):
    """The kernel's code is the FP16 word of ``fp32(raw * coef' + anchor')`` (units of 2^-24), clipped at 0."""
    raw = torch.randn(200_000) * 1e4
    coef = torch.rand(200_000) * 1e-3
    anchor = torch.round(torch.rand(200_000) * 120 - raw * coef)
    unit = torch.tensor(CODE_UNIT)
    ffma = torch.addcmul((anchor * unit).double(), raw.double(), (coef * unit).double()).float()
    words = ffma.half().view(torch.int16).int()
    expected = torch.where(ffma > 0, words, 0).clamp(max=MAX_CODE)
    codes = anchored_encode(raw, coef, anchor)
    assert torch.equal(codes.int(), expected), f"seed {fresh_seed}"
    assert 0 < (codes == 0).sum() < codes.numel() and (codes > 100).any()


def test_anchored_encode_rounds_twice():
    """raw * coef + anchor = 100.5 + 2^-23 + 2^-47: FP32 keeps 100.5, whose RNE is 100 (one rounding: 101)."""
    raw, coef = torch.tensor(1 + 2.0**-23), torch.tensor(0.5 + 2.0**-24)
    assert anchored_encode(raw, coef, torch.tensor(100.0)).item() == 100
