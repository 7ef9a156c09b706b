"""The example scripts, end to end on the tiny pipeline (CPU, small sizes)."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import imageio.v3 as iio
import numpy as np
import pytest
import torch
from diffusers.models.transformers import transformer_wan
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_families import BUILDERS, build, forward
from tqdm.auto import tqdm

from openvc_diffusers import load_config
from openvc_kernels import reference_attention
from openvc_diffusers.pipelines import call_kwargs, install, load_pipeline, steps_kwargs

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    # Mochi's RoPE asks for float32 autocast, which the CPU does not have; it runs in float32 regardless.
    pytest.mark.filterwarnings("ignore:In CPU autocast:UserWarning"),
]

EXAMPLES = Path(__file__).parents[1] / "examples"
SCRIPTS = ["generate", "compare", "calibrate", "capture"]


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_example", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", SCRIPTS)
def test_help(name, capsys):
    with pytest.raises(SystemExit) as exit:
        load_example(name).main(["--help"])
    assert exit.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_generate_writes_videos_and_compares_them(tmp_path):
    results = load_example("generate").main(["--output", str(tmp_path), "--steps", "2", "--device", "cpu"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bf16.mp4", "openvc.mp4", "side_by_side.mp4"]
    assert all(p.stat().st_size > 0 for p in tmp_path.iterdir())
    # Open-VC changes the numerics, so the videos differ, but only slightly.
    assert 30 < results["psnr"] < float("inf")
    assert 0.9 < results["ssim"] < 1.0
    assert results["calls"][("self", "openvc-reference")] > 0


def test_missing_model_offline_says_how_to_point_at_a_folder(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)}
    command = [sys.executable, str(EXAMPLES / "generate.py"), "--model", "no-such-org/no-such-model"]
    done = subprocess.run(command, check=False, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert "Cannot load --model 'no-such-org/no-such-model'" in done.stderr
    assert "--model /path/to/model" in done.stderr


def test_model_from_a_local_folder(tmp_path):
    # A pipeline folder as save_pretrained writes it (and hub downloads look): loaded in bfloat16.
    load_pipeline().save_pretrained(tmp_path / "model")
    path = tmp_path / "qkv.safetensors"
    argv = ["--model", str(tmp_path / "model"), "--frames", "5", "--height", "128", "--width", "160"]
    load_example("capture").main([*argv, "--num-inference-steps", "2", "--output", str(path)])
    metadata = safe_open(path, "pt").metadata()
    assert metadata["model"] == str(tmp_path / "model") and metadata["dtype"] == "bfloat16"


def write_lossless(path: Path, video: np.ndarray) -> None:
    # PNG-coded AVI: the uint8 frames read back exactly, unlike mp4.
    iio.imwrite(path, (video * 255).round().astype(np.uint8), fps=8, codec="png", pixelformat="rgb24")


def test_compare_folders(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "lpips", None)  # as if not installed
    rng = np.random.default_rng(0)
    # Mid-range values, so that the noise is never clipped at 0 or 1.
    video = (rng.uniform(0.3, 0.7, size=(6, 64, 64, 3)) * 255).round() / 255
    sigma = 0.03
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for folder in ("a", "b"):
        write_lossless(tmp_path / folder / "same.avi", video)
    write_lossless(tmp_path / "a" / "noisy.avi", video)
    write_lossless(tmp_path / "b" / "noisy.avi", video + rng.normal(0.0, sigma, size=video.shape))
    write_lossless(tmp_path / "a" / "only_here.avi", video)

    out = tmp_path / "out"
    results = load_example("compare").main([str(tmp_path / "a"), str(tmp_path / "b"), "--output", str(out)])

    assert list(results) == ["noisy.avi", "same.avi"]
    same, noisy = results["same.avi"], results["noisy.avi"]
    assert same["psnr"] == math.inf and same["psnr_per_frame"] == [math.inf] * 6
    assert same["ssim"] == pytest.approx(1.0)
    expected = 20 * math.log10(1 / sigma)
    assert noisy["psnr"] == pytest.approx(expected, abs=0.2)
    assert noisy["psnr_per_frame"] == pytest.approx([expected] * 6, abs=0.2)
    assert 0 < noisy["ssim"] < 1 and len(noisy["ssim_per_frame"]) == 6
    printed = capsys.readouterr().out
    assert "only_here.avi is in only one of the folders" in printed
    assert "LPIPS skipped" in printed
    assert sorted(p.name for p in out.iterdir()) == ["compare.csv", "compare_psnr.png"]
    assert len((out / "compare.csv").read_text().splitlines()) == 1 + 2 * 6


def test_compare_lpips_takes_frames_in_minus_one_to_one():
    class FakeLPIPS:  # the lpips package's interface: (N, 3, H, W) in [-1, 1] -> (N, 1, 1, 1)
        def __call__(self, x, y):
            assert x.shape == (1, 3, 16, 16) and x.min() >= -1 and x.max() <= 1
            return (x - y).abs().mean().reshape(1, 1, 1, 1)

    compare = load_example("compare").compare
    a = np.zeros((2, 16, 16, 3), dtype=np.float32)
    b = a.copy()
    b[1] = 0.5
    result = compare(a, b, lpips_model=FakeLPIPS())
    assert result["lpips_per_frame"] == pytest.approx([0.0, 1.0])
    assert result["lpips"] == pytest.approx(0.5)


def test_calibrate_keeps_exactly_the_layers_above_the_threshold(tmp_path):
    calibrate = load_example("calibrate")
    first = calibrate.main(["--output", str(tmp_path / "first"), "--threshold", "1"])
    errors = first["rel_l2"]
    assert list(errors) == [0, 1] and all(0 < e < 0.1 for e in errors.values())
    assert errors[0] != errors[1]
    assert load_config(tmp_path / "first" / "calibrated.yaml").bf16_layers == frozenset()

    # Start from a config that keeps every layer in BF16: they are measured all the same, and replaced.
    start = tmp_path / "start.yaml"
    start.write_text("backends: [openvc, sdpa]\nmin_tokens: 0\nbf16_layers: [0, 1]\nbf16_steps: [3]\n")
    threshold = sum(errors.values()) / 2
    second = calibrate.main(["--output", str(tmp_path), "--config", str(start), "--threshold", str(threshold)])
    assert second["rel_l2"] == errors
    config = load_config(tmp_path / "calibrated.yaml")
    assert config.bf16_layers == {max(errors, key=errors.get)}
    assert (config.backends, config.bf16_steps, config.min_tokens) == (("openvc", "sdpa"), {3}, 0)
    assert (tmp_path / "calibration.png").stat().st_size > 0


def first_stock_attention_inputs(monkeypatch, kwargs) -> tuple[torch.Tensor, ...]:
    """q, k, v of the first attention call diffusers' own Wan processor makes (layer 0, step 0)."""
    seen = []

    class Seen(Exception):
        pass

    def record(query, key, value, **_):
        seen.extend([query, key, value])
        raise Seen

    monkeypatch.setattr(transformer_wan, "dispatch_attention_fn", record)
    with pytest.raises(Seen), torch.no_grad():
        load_pipeline()(**kwargs, output_type="latent")
    return tuple(seen)


def test_capture_round_trips_what_the_attention_call_sees(tmp_path, monkeypatch):
    capture = load_example("capture")
    path = tmp_path / "qkv.safetensors"
    argv = ["--output", str(path), "--layers", "0-1", "--steps", "0,1"]
    captured = capture.main(argv)

    tensors = load_file(path)
    names = [f"step{t}.layer{l}.{x}" for t in (0, 1) for l in (0, 1) for x in "qkv"]
    assert sorted(tensors) == sorted(names)
    for name in names:
        assert tensors[name].shape == (1, 160, 2, 128) and tensors[name].dtype == torch.float32
        assert torch.equal(tensors[name], captured[name])
    metadata = safe_open(path, "pt").metadata()
    assert metadata["format"] == "openvc-qkv/1" and metadata["model"] == "tiny" and metadata["dtype"] == "float32"
    assert json.loads(metadata["shapes"])["step1.layer0.q"] == [1, 160, 2, 128]
    assert (metadata["steps"], metadata["layers"]) == ("0,1", "0,1")
    assert not torch.equal(tensors["step0.layer1.q"], tensors["step1.layer1.q"])

    args = capture.parse_args(argv)
    q, k, v = first_stock_attention_inputs(monkeypatch, {**call_kwargs(args), **steps_kwargs(args, None)})
    assert torch.equal(tensors["step0.layer0.q"], q)
    assert torch.equal(tensors["step0.layer0.k"], k)
    assert torch.equal(tensors["step0.layer0.v"], v)


def test_bench_attention_reads_captured_inputs(tmp_path):
    path = tmp_path / "qkv.safetensors"
    captured = load_example("capture").main(["--output", str(path), "--layers", "0,1", "--steps", "0"])
    loaded = load_example("bench_attention").load_captured(str(path))
    assert [name for name, _ in loaded] == ["step0.layer0", "step0.layer1"]
    for name, qkv in loaded:
        for x, tensor in zip("qkv", qkv):
            assert torch.equal(tensor, captured[f"{name}.{x}"])


def test_bench_attention_rejects_files_it_cannot_read(tmp_path, capsys):
    bench = load_example("bench_attention")
    qkv = {f"step0.layer0.{x}": torch.randn(1, 8, 2, 128) for x in "qkv"}
    save_file(qkv, tmp_path / "other.safetensors")
    with pytest.raises(ValueError, match="format None, expected 'openvc-qkv/1'"):
        bench.load_captured(str(tmp_path / "other.safetensors"))
    capture_format = {"format": "openvc-qkv/1"}
    del qkv["step0.layer0.v"]
    save_file(qkv, tmp_path / "partial.safetensors", metadata=capture_format)
    with pytest.raises(ValueError, match=r"step0.layer0 has \['k', 'q'\], expected q, k and v"):
        bench.load_captured(str(tmp_path / "partial.safetensors"))
    with pytest.raises(SystemExit):
        bench.main(["--inputs", str(tmp_path / "partial.safetensors"), "--repair"])
    with pytest.raises(SystemExit):
        bench.main(["--inputs", str(tmp_path / "missing.safetensors")])
    assert "missing.safetensors: no such file (examples/capture.py writes one)" in capsys.readouterr().err


def test_bench_attention_rows_with_stand_in_backends(monkeypatch):
    """The benchmark's bookkeeping on the CPU: the reference stands in for the kernel, SDPA for FA4 and cuDNN,
    every call 'takes' 2 ms; inputs Open-VC refuses leave its methods out and keep the others."""
    bench = load_example("bench_attention")
    sdpa = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
        *(t.transpose(1, 2) for t in (q, k, v))
    ).transpose(1, 2)
    for name, stand_in in {
        "time_ms": lambda fn, sets, budget_ms=0: (fn(*sets[0]), 2.0)[1],
        "clocks": lambda: "-",
        "prepare": lambda q, k, v: (q, k, v),
        "attention_prepared": lambda p, out, softmax_scale: out.copy_(reference_attention(*p)),
        "attention": lambda q, k, v: reference_attention(q, k, v),
        "run_fa4": sdpa,
        "run_cudnn": sdpa,
    }.items():
        monkeypatch.setattr(bench, name, stand_in)
    q, k, v = (torch.randn(2, s, 2, 128, dtype=torch.bfloat16) for s in (200, 150, 150))
    row = bench.bench_sets([[q, k, v]], {"seq": 200, "heads": 2, "label": "step0.layer1"})
    methods = {"openvc_kernel", "openvc_prepare", "openvc_call", "fa4_bf16", "cudnn_bf16"}
    assert set(row["ms"]) == methods and set(row["ms"].values()) == {2.0} and "errors" not in row
    assert "openvc_prepare" not in row["tflops"]  # no attention FLOPs in the preparation
    assert row["tflops"]["fa4_bf16"] == pytest.approx(4 * 2 * 200 * 150 * 2 * 128 / 2e-3 / 1e12)
    assert 0.04 < row["rel_l2_vs_float64"] < 0.08 and 0.04 < row["rel_l2_vs_fa4"] < 0.08
    assert row["fa4_rel_l2_vs_float64"] < 0.01
    assert "step0.layer1 |   2.00 ms" in bench.table([row])

    def refuse(q, k, v):
        raise ValueError("head_dim must be 128")

    monkeypatch.setattr(bench, "prepare", refuse)
    monkeypatch.setattr(bench, "attention", refuse)
    row = bench.bench_sets([[q, k, v]], {"seq": 200, "heads": 2, "label": "refused"})
    assert sorted(row["errors"]) == ["openvc_call", "openvc_kernel", "openvc_prepare"]
    assert math.isnan(row["ms"]["openvc_call"]) and row["ms"]["fa4_bf16"] == 2.0 and "rel_l2_vs_fa4" not in row


@pytest.mark.parametrize("name", BUILDERS)
def test_calibration_and_capture_work_on_every_family(name):
    model, inputs = build(name)
    stock = forward(model, inputs)

    calibration = install(model, load_example("calibrate").Calibration, {"min_tokens": 0}, progress=tqdm(disable=True))
    assert torch.equal(forward(model, inputs), stock)  # the model runs on stock attention while it is measured
    assert sorted(calibration.layers) == list(range(len(calibration.layers))) and calibration.layers
    # CogVideoX's head dim 64 takes the fallback: the same numbers as stock.
    assert all((e.rel_l2 == 0) == (name == "cogvideox") and e.rel_l2 < 0.05 for e in calibration.layers.values())

    model, inputs = build(name)  # apply() takes diffusers' processors, or exactly its own
    example = load_example("capture")
    capture = install(model, example.Capture, {"backends": ["sdpa"]}, layers=[1], steps=[0])
    with pytest.raises(example.CaptureComplete):
        forward(model, inputs)
    q, k, v = (capture.tensors[f"step0.layer1.{x}"] for x in "qkv")
    # (B, S, H, D); Mochi attends one batch row per call.
    assert k.shape == v.shape and (q.shape[0], *q.shape[2:]) == (k.shape[0], *k.shape[2:])
    assert q.shape[-1] == (64 if name == "cogvideox" else 128)
