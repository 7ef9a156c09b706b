"""Reading videos back as arrays, for comparing what the examples wrote."""

import os

import imageio.v3 as iio
import numpy as np

VIDEO_EXTENSIONS = (".mp4", ".webm", ".mkv", ".mov", ".avi", ".gif")


def read_video(path: str | os.PathLike) -> np.ndarray:
    """All frames of an 8-bit RGB video file as float32 (F, H, W, 3) in [0, 1], the layout `metrics` takes."""
    frames = iio.imread(path)
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(
            f"{os.fspath(path)!r}: expected 8-bit RGB frames (F, H, W, 3), got {frames.dtype} {frames.shape}"
        )
    return frames.astype(np.float32) / 255
