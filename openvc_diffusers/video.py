"""Reading videos back as arrays, for comparing what the examples wrote, and whether this machine can write them."""

import os

import imageio.v3 as iio
import numpy as np

VIDEO_EXTENSIONS = (".mp4", ".webm", ".mkv", ".mov", ".avi", ".gif")
_PAIR_RULE = "the videos of a pair need the same number and size of frames"


class VideoError(ValueError):
    """A file that cannot be read as an 8-bit RGB video, or a pair of videos that do not match; the one-line
    message names the files and the problem."""


def writer_missing() -> str | None:
    """Why this machine cannot write mp4 files, or None: diffusers' ``export_to_video`` runs the ffmpeg that
    imageio-ffmpeg finds (its own binary, ``IMAGEIO_FFMPEG_EXE`` or one on the PATH)."""
    try:
        import imageio_ffmpeg
    except ImportError:
        return "imageio-ffmpeg is not installed (pip install imageio-ffmpeg)"
    try:
        imageio_ffmpeg.get_ffmpeg_exe()
    except RuntimeError as e:
        return f"imageio-ffmpeg finds no ffmpeg ({str(e).strip().splitlines()[0]})"
    return None


def read_video(path: str | os.PathLike) -> np.ndarray:
    """All frames of an 8-bit RGB video file as float32 (F, H, W, 3) in [0, 1], the layout `metrics` takes."""
    frames = _open(iio.imread, path)
    _check_layout(path, frames.shape, frames.dtype)
    return frames.astype(np.float32) / 255


def frame_size(path: str | os.PathLike) -> tuple[int, int]:
    """(height, width) of a video's frames, from its header: checks that a file is a video without decoding it."""
    properties = _open(iio.improps, path)
    _check_layout(path, properties.shape, properties.dtype)
    return properties.shape[1:3]


def check_pair(reference: str | os.PathLike, candidate: str | os.PathLike) -> None:
    """Both files are videos with frames of one size, from their headers (frame counts are known once read)."""
    (ref_height, ref_width), (height, width) = frame_size(reference), frame_size(candidate)
    if (ref_height, ref_width) != (height, width):
        raise VideoError(
            f"{os.fspath(reference)!r} has frames of {ref_width}x{ref_height} but {os.fspath(candidate)!r} of "
            f"{width}x{height}; {_PAIR_RULE}"
        )


def read_pair(reference: str | os.PathLike, candidate: str | os.PathLike) -> tuple[np.ndarray, np.ndarray]:
    """Both videos of a pair, which must have the same number and size of frames."""
    a, b = read_video(reference), read_video(candidate)
    if a.shape != b.shape:
        raise VideoError(
            f"{os.fspath(reference)!r} has {_describe(a.shape)} but {os.fspath(candidate)!r} has {_describe(b.shape)}; "
            f"{_PAIR_RULE}"
        )
    return a, b


def _describe(shape: tuple) -> str:
    """'81 frames of 832x480' for (81, 480, 832, 3): frames, then width x height as video players give them."""
    frames, height, width = shape[:3]
    return f"{frames} frames of {width}x{height}"


def _open(reader, path: str | os.PathLike):
    try:
        return reader(path)
    except FileNotFoundError:
        raise VideoError(f"{os.fspath(path)!r}: no such file") from None
    except OSError as e:  # imageio's "no backend", ffmpeg's "could not load meta information", a folder
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise VideoError(f"{os.fspath(path)!r} is not a video imageio can read ({reason})") from None


def _check_layout(path: str | os.PathLike, shape: tuple, dtype: np.dtype) -> None:
    if len(shape) == 3:
        raise VideoError(f"{os.fspath(path)!r} holds a single image ({shape[1]}x{shape[0]}), not a video")
    if dtype != np.uint8 or len(shape) != 4 or shape[-1] != 3:
        raise VideoError(f"{os.fspath(path)!r}: expected 8-bit RGB frames (F, H, W, 3), got {dtype} {shape}")
