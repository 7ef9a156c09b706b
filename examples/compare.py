"""Compare two videos, or two folders of videos matched by file name: PSNR and SSIM per frame and overall,
and LPIPS when the `lpips` package is installed.

    python examples/compare.py outputs/bf16.mp4 outputs/openvc.mp4
    python examples/compare.py runs/bf16/ runs/openvc/ --output runs/

Prints one row per pair: PSNR of the whole video (the error pooled over all frames, so one identical frame
does not make it infinite), its worst frame, mean SSIM and mean LPIPS. Writes to --output compare.csv (every
frame's values) and compare_psnr.png (per-frame PSNR; needs matplotlib: pip install "openvc-diffusers[examples]";
identical frames have infinite PSNR and are left out of the plot). The videos of a pair must have the same
number and size of frames.

MP4 is lossy: its compression noise adds to the difference being measured, so PSNR between two mp4 files is
lower than the PSNR generate.py prints, which it takes on the frames before encoding.
"""

import argparse
import csv
import os
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from openvc_diffusers import cli
from openvc_diffusers.metrics import psnr, psnr_per_frame, ssim_per_frame
from openvc_diffusers.video import VIDEO_EXTENSIONS, VideoError, check_pair, read_pair


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reference", type=Path, help="a video, or a folder of videos (e.g. the BF16 runs)")
    parser.add_argument("candidate", type=Path, help="a video, or a folder of videos with the same file names")
    parser.add_argument(
        "--output",
        type=cli.writable_dir,
        default="outputs",
        help="directory for compare.csv and compare_psnr.png (default: outputs)",
    )
    parser.add_argument(
        "--device",
        type=cli.device,
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cpu, cuda or cuda:N for LPIPS (default: cuda if available)",
    )
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    """The arguments, with ``pairs``: (name, reference, candidate) of each pair of videos, every file checked to
    be a video and the two of a pair to have frames of one size (their frame counts are known once read)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.pairs = video_pairs(args.reference, args.candidate)
        for _, reference, candidate in args.pairs:
            check_pair(reference, candidate)
    except ValueError as e:  # VideoError among them
        parser.error(str(e))
    return args


def video_pairs(reference: Path, candidate: Path) -> list[tuple[str, Path, Path]]:
    """(name, reference, candidate) for two files, or for the files two folders share by name."""
    for path in (reference, candidate):
        if not path.exists():
            raise ValueError(f"{str(path)!r}: no such file or folder")
    if reference.is_file() and candidate.is_file():
        return [(candidate.name, reference, candidate)]
    if not (reference.is_dir() and candidate.is_dir()):
        raise ValueError(f"expected two video files or two folders, got {str(reference)!r} and {str(candidate)!r}")

    def videos(folder):
        return {p.name for p in folder.iterdir() if p.suffix.lower() in VIDEO_EXTENSIONS}

    in_reference, in_candidate = videos(reference), videos(candidate)
    if not in_reference & in_candidate:
        raise ValueError(f"no video file names in common between {str(reference)!r} and {str(candidate)!r}")
    for name in sorted(in_reference ^ in_candidate):
        print(f"note: {name} is in only one of the folders; skipped")
    return [(name, reference / name, candidate / name) for name in sorted(in_reference & in_candidate)]


def load_lpips(device: str):
    """The LPIPS (AlexNet) model, or None with a note when the package or its weights are not there."""
    try:
        import lpips
    except ImportError:
        print("note: LPIPS skipped: the lpips package is not installed (pip install lpips)")
        return None
    try:
        return lpips.LPIPS(net="alex", verbose=False).to(device).eval()
    except OSError as e:  # the AlexNet weights are downloaded on first use
        print(f"note: LPIPS skipped: its network weights could not be loaded ({e})")
        return None


@torch.no_grad()
def lpips_per_frame(model, a: np.ndarray, b: np.ndarray, device: str) -> list[float]:
    """LPIPS of each frame of two (F, H, W, 3) videos in [0, 1]."""

    def as_input(frame):  # LPIPS takes (N, 3, H, W) in [-1, 1]
        return torch.from_numpy(frame).permute(2, 0, 1)[None].to(device, torch.float32) * 2 - 1

    return [model(as_input(x), as_input(y)).item() for x, y in zip(a, b)]


def compare(reference: np.ndarray, candidate: np.ndarray, lpips_model=None, device: str = "cpu") -> dict:
    """Metrics of one pair of (F, H, W, C) videos in [0, 1]: whole-video PSNR, and per frame PSNR, SSIM, LPIPS."""
    result = {
        "psnr": psnr(reference, candidate),
        "psnr_per_frame": psnr_per_frame(reference, candidate),
        "ssim_per_frame": ssim_per_frame(reference, candidate),
    }
    result["ssim"] = float(np.mean(result["ssim_per_frame"]))
    if lpips_model is not None:
        result["lpips_per_frame"] = lpips_per_frame(lpips_model, reference, candidate, device)
        result["lpips"] = float(np.mean(result["lpips_per_frame"]))
    return result


def write_csv(results: dict[str, dict], path: str) -> None:
    metrics = ["psnr", "ssim"] + (["lpips"] if all("lpips" in r for r in results.values()) else [])
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["video", "frame", *metrics])
        for name, result in results.items():
            per_frame = zip(*(result[f"{m}_per_frame"] for m in metrics))
            writer.writerows([name, frame, *values] for frame, values in enumerate(per_frame))


def plot_psnr(results: dict[str, dict], path: str) -> bool:
    """Per-frame PSNR, one line per pair; False (with a note) when matplotlib is not installed."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        print('note: no plot written: matplotlib is not installed (pip install "openvc-diffusers[examples]")')
        return False
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.subplots()
    for name, result in results.items():
        values = np.array(result["psnr_per_frame"])
        ax.plot(np.where(np.isinf(values), np.nan, values), marker=".", label=name)
    ax.set(xlabel="frame", ylabel="PSNR (dB)", title="PSNR per frame")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=120)
    return True


def print_table(results: dict[str, dict]) -> None:
    width = max(len("video"), *map(len, results))
    print(f"{'video':<{width}}  frames  PSNR dB  worst frame (dB)   SSIM    LPIPS")
    for name, r in results.items():
        worst = int(np.argmin(r["psnr_per_frame"]))
        lpips = f"{r['lpips']:7.4f}" if "lpips" in r else "      -"
        row = f"{name:<{width}}  {len(r['psnr_per_frame']):6d}  {r['psnr']:7.2f}"
        print(f"{row}  {worst:5d}: {r['psnr_per_frame'][worst]:7.2f}   {r['ssim']:.4f}  {lpips}")


def main(argv=None) -> dict[str, dict]:
    args = parse_args(argv)
    lpips_model = load_lpips(args.device)

    results = {}
    try:
        with tqdm(args.pairs, desc="comparing", unit="video") as pairs:  # closed before the error is printed
            for name, reference, candidate in pairs:
                results[name] = compare(*read_pair(reference, candidate), lpips_model, args.device)
    except VideoError as e:  # frame counts that differ: only reading the videos tells
        build_parser().error(str(e))

    print_table(results)
    os.makedirs(args.output, exist_ok=True)
    written = [os.path.join(args.output, "compare.csv")]
    write_csv(results, written[0])
    if plot_psnr(results, os.path.join(args.output, "compare_psnr.png")):
        written.append(os.path.join(args.output, "compare_psnr.png"))
    print(f"wrote {', '.join(written)}")
    return results


if __name__ == "__main__":
    main()
