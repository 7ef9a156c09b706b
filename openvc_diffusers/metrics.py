"""Similarity metrics between two generations, or between an attention output and its reference.

Images are (H, W) or (H, W, C); videos are (F, H, W, C), as `WanPipeline(output_type="np")` returns
them; any further leading dims count as more frames. Inputs may be numpy arrays or torch tensors and
are compared in float64.
"""

import math

import torch
import torch.nn.functional as F


def _as_float64_pair(a, b) -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.as_tensor(a).detach().to(torch.float64)
    b = torch.as_tensor(b).detach().to(device=a.device, dtype=torch.float64)
    if a.shape != b.shape:
        raise ValueError(f"Shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}.")
    return a, b


def psnr(a, b, data_range: float = 1.0) -> float:
    """Peak signal-to-noise ratio in dB; `inf` for identical inputs.

    The mean squared error is taken over the whole video rather than averaged per frame, so that one
    identical frame (the first frame often is) does not make the result infinite.
    """
    a, b = _as_float64_pair(a, b)
    mse = torch.mean((a - b) ** 2).item()
    if mse == 0:
        return math.inf
    return 10 * math.log10(data_range**2 / mse)


def _gaussian_window(size: int = 11, sigma: float = 1.5) -> torch.Tensor:
    x = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    window = torch.exp(-(x**2) / (2 * sigma**2))
    return window / window.sum()


def _frames(a, b) -> tuple[torch.Tensor, torch.Tensor]:
    # (..., H, W, C) -> (frames, H, W, C); an (H, W) image is one single-channel frame.
    a, b = _as_float64_pair(a, b)
    if a.ndim < 2:
        raise ValueError(f"SSIM and per-frame metrics take (H, W) or (..., H, W, C) images, got {tuple(a.shape)}.")
    if a.ndim == 2:
        a, b = a[..., None], b[..., None]
    return a.reshape(-1, *a.shape[-3:]), b.reshape(-1, *b.shape[-3:])


def ssim(a, b, data_range: float = 1.0) -> float:
    """Structural similarity (Wang et al. 2004): 11x11 Gaussian window with sigma 1.5, K1 = 0.01,
    K2 = 0.03, over valid window positions only; per channel, then averaged over channels and frames.
    """
    a, b = _frames(a, b)
    height, width, channels = a.shape[-3:]
    window = _gaussian_window().to(a.device)
    if min(height, width) < window.numel():
        raise ValueError(f"ssim needs images of at least {window.numel()}x{window.numel()}, got {height}x{width}.")

    # (frames, H, W, C) -> (frames * C, 1, H, W): every channel of every frame is one image.
    def as_images(x):
        return x.reshape(-1, height, width, channels).permute(0, 3, 1, 2).reshape(-1, 1, height, width)

    def blur(x):
        # The Gaussian is separable: one pass over rows, one over columns.
        x = F.conv2d(x, window.view(1, 1, -1, 1))
        return F.conv2d(x, window.view(1, 1, 1, -1))

    x, y = as_images(a), as_images(b)
    mu_x, mu_y = blur(x), blur(y)
    var_x = blur(x * x) - mu_x**2
    var_y = blur(y * y) - mu_y**2
    cov_xy = blur(x * y) - mu_x * mu_y

    c1 = (0.01 * data_range) ** 2
    c2 = (0.03 * data_range) ** 2
    ssim_map = ((2 * mu_x * mu_y + c1) * (2 * cov_xy + c2)) / ((mu_x**2 + mu_y**2 + c1) * (var_x + var_y + c2))
    # Every image has the same number of window positions, so the mean of per-channel, per-frame
    # means is the mean over all of them.
    return ssim_map.mean().item()


def psnr_per_frame(a, b, data_range: float = 1.0) -> list[float]:
    """PSNR of each frame in dB, `inf` for identical frames; `psnr` pools the error over all of them."""
    a, b = _frames(a, b)
    return [psnr(x, y, data_range) for x, y in zip(a, b)]


def ssim_per_frame(a, b, data_range: float = 1.0) -> list[float]:
    """SSIM of each frame; their mean is `ssim(a, b)`. One frame at a time: far less memory than `ssim` of a
    whole long video takes."""
    a, b = _frames(a, b)
    return [ssim(x, y, data_range) for x, y in zip(a, b)]


def rel_l2(out, ref) -> float:
    """Relative L2 error ||out - ref|| / ||ref||, in float64."""
    out, ref = _as_float64_pair(out, ref)
    return (torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref)).item()
