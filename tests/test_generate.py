import importlib.util
from pathlib import Path

EXAMPLE = Path(__file__).parents[1] / "examples" / "generate.py"


def load_example():
    spec = importlib.util.spec_from_file_location("generate_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_main_job_writes_videos_and_compares_them(tmp_path):
    results = load_example().main(["--output", str(tmp_path), "--steps", "2", "--device", "cpu"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bf16.mp4", "openvc.mp4", "side_by_side.mp4"]
    assert all(p.stat().st_size > 0 for p in tmp_path.iterdir())
    # Open-VC changes the numerics, so the videos differ, but only slightly.
    assert 30 < results["psnr"] < float("inf")
    assert 0.9 < results["ssim"] < 1.0
