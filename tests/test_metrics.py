import math

import numpy as np
import pytest
import torch

from openvc_diffusers.metrics import psnr, psnr_per_frame, rel_l2, ssim, ssim_per_frame


@pytest.fixture
def video():
    # Mid-range values, so that added noise of the sizes below is never clipped at 0 or 1.
    rng = np.random.default_rng(0)
    return rng.uniform(0.3, 0.7, size=(4, 64, 64, 3))


def noisy(video, sigma, seed=1):
    return video + np.random.default_rng(seed).normal(0.0, sigma, size=video.shape)


def test_identical_inputs(video):
    assert psnr(video, video) == math.inf
    assert ssim(video, video) == pytest.approx(1.0)
    assert psnr(torch.from_numpy(video), video) == math.inf


@pytest.mark.parametrize("sigma", [0.01, 0.03, 0.1])
def test_psnr_of_gaussian_noise(video, sigma):
    assert psnr(video, noisy(video, sigma)) == pytest.approx(20 * math.log10(1 / sigma), abs=0.2)


def test_psnr_data_range(video):
    # Scaling both signal and range by 255 leaves PSNR unchanged.
    other = noisy(video, 0.03)
    assert psnr(255 * video, 255 * other, data_range=255) == pytest.approx(psnr(video, other))


def test_ssim_decreases_with_noise(video):
    scores = [ssim(video, noisy(video, sigma)) for sigma in (0.01, 0.03, 0.1)]
    assert 1.0 > scores[0] > scores[1] > scores[2] > 0.0


def test_ssim_accepts_numpy_torch_and_images(video):
    other = noisy(video, 0.03)
    expected = ssim(video, other)
    assert ssim(torch.from_numpy(video).float(), torch.from_numpy(other).float()) == pytest.approx(expected, abs=1e-5)
    # A video's SSIM is the mean over its frames, and a grayscale image is a single channel.
    assert np.mean([ssim(a, b) for a, b in zip(video, other)]) == pytest.approx(expected)
    assert ssim(video[0, ..., 0], other[0, ..., 0]) == pytest.approx(ssim(video[0, ..., :1], other[0, ..., :1]))


def test_per_frame_metrics(video):
    other = noisy(video, 0.03)
    other[0] = video[0]  # an identical frame: infinite PSNR there, finite over the video
    assert psnr_per_frame(video, other)[0] == math.inf
    assert psnr_per_frame(video, other)[1:] == pytest.approx([psnr(a, b) for a, b in zip(video[1:], other[1:])])
    assert psnr(video, other) < math.inf
    assert np.mean(ssim_per_frame(video, other)) == pytest.approx(ssim(video, other))
    assert ssim_per_frame(video[0, ..., 0], other[1, ..., 0]) == [ssim(video[0, ..., 0], other[1, ..., 0])]


def test_rel_l2():
    ref = torch.tensor([3.0, 4.0], dtype=torch.bfloat16)
    out = torch.tensor([3.0, 5.0], dtype=torch.bfloat16)
    assert rel_l2(out, ref) == 0.2  # ||(0, 1)|| / ||(3, 4)|| = 1 / 5
    assert rel_l2(ref, ref) == 0.0


@pytest.mark.parametrize("metric", [psnr, ssim, rel_l2])
def test_shape_mismatch(video, metric):
    with pytest.raises(ValueError, match=r"\(4, 64, 64, 3\).*\(4, 64, 32, 3\)"):
        metric(video, video[:, :, :32])
