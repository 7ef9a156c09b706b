import pytest
import torch

from openvc_kernels import expcast_decode, expcast_encode
from openvc_kernels.expcast import MAX_CODE, anchored_encode, code_anchor


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
