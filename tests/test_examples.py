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
from openvc_diffusers.pipelines import TINY_ROPE_POSITIONS, call_kwargs, install, load_pipeline, steps_kwargs
from openvc_diffusers.tiny import tiny_wan_transformer

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
    # Registered as imported modules are: dynamo (torch 2.11) looks a traced function's module up by its name.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", SCRIPTS)
def test_help(name, capsys):
    with pytest.raises(SystemExit) as exit:
        load_example(name).main(["--help"])
    assert exit.value.code == 0
    assert "usage:" in capsys.readouterr().out


def argument_error(capsys, run, argv) -> str:
    """The message ``run(argv)`` exits with: argparse's usage, then one ``prog: error: ...`` line, status 2."""
    with pytest.raises(SystemExit) as exit:
        run(argv)
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    usage, message = err.rstrip("\n").rsplit("\n", 1)
    assert "usage: " in usage  # after any progress bar
    assert ": error: " in message
    return message.split(": error: ", 1)[1]


def unavailable(*_, **__):
    pytest.fail("the script went on to load a model or run with bad arguments")


def without_pipeline(name: str):
    """The script ``name``, its pipeline loading made to fail the test: argument errors must come first."""
    script = load_example(name)
    script.load_pipeline = unavailable
    return script


@pytest.fixture
def one_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


PIPELINE_SCRIPTS = ["generate", "calibrate", "capture"]
# (arguments, what the one-line error says), for every script that runs a pipeline.
BAD_PIPELINE_ARGUMENTS = [
    (["--height", "100"], "argument --height: 100 is not a multiple of 16 (Wan's VAE downsamples 8x"),
    (["--height", "100"], "try 96 or 112"),
    (["--width", "8"], "argument --width: 8 is not a multiple of 16"),
    (["--width", "0"], "argument --width: 0: expected an integer >= 1"),
    (["--height", "tall"], "argument --height: 'tall' is not an integer"),
    (["--frames", "80"], "argument --frames: 80 is not of the form 4k + 1"),
    (["--frames", "80"], "try 77 or 81"),
    (["--frames", "129"], "argument --frames: 129 is more than the tiny model's 125 (its RoPE covers 32 latent"),
    (["--height", "528"], "argument --height: 528 is more than the tiny model's 512 (its RoPE covers 32 patches"),
    (["--width", "1024", "--tiny"], "argument --width: 1024 is more than the tiny model's 512"),
    (["--device", "gpu"], "argument --device: 'gpu' is not a device; choose from cpu"),
    (["--device", "meta"], "argument --device: 'meta': the scripts run on cpu or cuda; choose from cpu"),
    (["--config", "missing.yaml"], "argument --config: config file not found: 'missing.yaml'"),
    (["--seed", "x"], "argument --seed: 'x' is not an integer"),
    (["--seed", str(2**64)], f"argument --seed: {2**64}: expected a seed from -2**63 to 2**64 - 1"),
]


@pytest.mark.parametrize("name", PIPELINE_SCRIPTS)
@pytest.mark.parametrize("argv, expected", BAD_PIPELINE_ARGUMENTS)
def test_pipeline_scripts_refuse_bad_arguments_before_loading(name, argv, expected, capsys, no_gpu):
    assert expected in argument_error(capsys, without_pipeline(name).main, argv)


@pytest.mark.parametrize("name", PIPELINE_SCRIPTS)
def test_device_must_exist(name, capsys, monkeypatch):
    main = without_pipeline(name).main
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert argument_error(capsys, main, ["--device", "cuda"]) == (
        "argument --device: 'cuda': torch sees no CUDA GPU on this machine; choose from cpu"
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert argument_error(capsys, main, ["--device", "cuda:3"]) == (
        "argument --device: 'cuda:3': this machine has 1 CUDA GPU; choose from cpu, cuda, cuda:0"
    )


@pytest.mark.parametrize("name", PIPELINE_SCRIPTS)
def test_config_errors_name_the_key(name, tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("min_token: 0\n")
    message = argument_error(capsys, without_pipeline(name).main, ["--config", str(bad)])
    assert message.startswith("argument --config: unknown key 'min_token'. Did you mean 'min_tokens'?")
    bad.write_text("backends: [openvc\n")  # YAML's own message spans lines
    assert "is not valid YAML" in argument_error(capsys, without_pipeline(name).main, ["--config", str(bad)])
    bad.write_text("parallel:\n  ring_degree: 2\n")  # refused before the stock run, not by apply() after it
    assert "sets parallel.ring_degree 2, which needs one process per GPU" in argument_error(
        capsys, without_pipeline(name).main, ["--config", str(bad)]
    )


@pytest.mark.parametrize("name", ["generate", "calibrate"])
def test_output_directory_must_be_writable(name, tmp_path, capsys, monkeypatch):
    main = without_pipeline(name).main
    file = tmp_path / "file"
    file.write_text("")
    assert argument_error(capsys, main, ["--output", str(file)]) == (
        f"argument --output: {str(file)!r} is a file, not a directory"
    )
    assert argument_error(capsys, main, ["--output", str(file / "videos")]) == (
        f"argument --output: {str(file / 'videos')!r} cannot be created: {str(file)!r} is not a directory"
    )
    # Permissions as a user other than root sees them (root may write anywhere).
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    assert argument_error(capsys, main, ["--output", str(tmp_path)]) == (
        f"argument --output: {str(tmp_path)!r}: directory not writable"
    )
    assert argument_error(capsys, main, ["--output", str(tmp_path / "new")]) == (
        f"argument --output: {str(tmp_path / 'new')!r} cannot be created: {str(tmp_path)!r} is not writable"
    )


def test_generate_refuses_bad_steps_and_fps(capsys):
    main = without_pipeline("generate").main
    assert argument_error(capsys, main, ["--steps", "0"]) == "argument --steps: 0: expected an integer >= 1"
    assert argument_error(capsys, main, ["--fps", "0"]) == "argument --fps: 0: expected an integer >= 1"
    assert argument_error(capsys, main, ["--fps", "12.5"]) == "argument --fps: '12.5' is not an integer"


@pytest.mark.parametrize("threshold", ["-0.1", "nan", "inf", "high"])
def test_calibrate_refuses_a_threshold_out_of_range(threshold, capsys):
    message = argument_error(capsys, without_pipeline("calibrate").main, ["--threshold", threshold])
    if threshold == "high":
        assert message == "argument --threshold: 'high' is not a number"
    else:
        assert message == f"argument --threshold: {threshold}: expected a finite number >= 0"


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--layers", "0-1000000000"], "argument --layers: '0-1000000000': expected indices 0-999 and ranges a-b"),
        (["--layers", "2-1"], "argument --layers: '2-1': expected indices 0-999 and ranges a-b with a <= b"),
        (["--steps", "0,x"], "argument --steps: '0,x': expected indices 0-999"),
        (["--steps", "3,4,5"], "argument --steps: 4, 5 past the end of the 4-step denoising schedule (steps 0-3)"),
        (["--num-inference-steps", "8", "--steps", "8"], "8 past the end of the 8-step denoising schedule"),
        (["--num-inference-steps", "0"], "argument --num-inference-steps: 0: expected an integer >= 1"),
    ],
)
def test_capture_refuses_bad_indices(argv, expected, capsys):
    assert expected in argument_error(capsys, without_pipeline("capture").main, argv)


def test_capture_output_must_be_a_writable_file(tmp_path, capsys):
    main = without_pipeline("capture").main
    assert argument_error(capsys, main, ["--output", str(tmp_path)]) == (
        f"argument --output: {str(tmp_path)!r} is a directory; expected a file path"
    )
    file = tmp_path / "file"
    file.write_text("")
    assert argument_error(capsys, main, ["--output", str(file / "qkv.safetensors")]) == (
        f"argument --output: {str(file / 'qkv.safetensors')!r} cannot be created: {str(file)!r} is not a directory"
    )


def test_valid_arguments_pass_the_checks(tmp_path, one_gpu):
    # The tiny model's largest video, a folder the script will create, the one GPU there is.
    largest = ["--frames", "125", "--height", "512", "--width", "512", "--device", "cuda:0"]
    args = load_example("generate").parse_args([*largest, "--output", str(tmp_path / "new" / "dir")])
    assert (args.frames, args.height, args.width, args.device) == (125, 512, 512, "cuda:0")
    # A real Wan's RoPE covers 1024 positions per axis: the tiny model's limits do not apply to --model.
    args = load_example("calibrate").parse_args(["--model", "some/model", "--frames", "129", "--height", "1024"])
    assert (args.frames, args.height) == (129, 1024)
    # Wan's size rules are the tiny model's: other families have their own (Mochi: 6k + 1 frames).
    args = load_example("generate").parse_args(["--model", "genmo/mochi-1-preview", "--frames", "19"])
    assert args.frames == 19
    args = load_example("capture").parse_args(["--model", "some/model", "--steps", "40", "--layers", "0-999"])
    assert args.steps == [40] and args.layers == list(range(1000))


def test_tiny_size_limits_are_what_its_rope_takes():
    model = tiny_wan_transformer()
    assert model.config.rope_max_seq_len == TINY_ROPE_POSITIONS
    # RoPE positions: latent frames, and patches (of 2 latents) per axis.
    model.rope(torch.zeros(1, 4, TINY_ROPE_POSITIONS, 2 * TINY_ROPE_POSITIONS, 2 * TINY_ROPE_POSITIONS))
    for latent in [(TINY_ROPE_POSITIONS + 1, 2, 2), (1, 2 * TINY_ROPE_POSITIONS + 2, 2)]:
        with pytest.raises(RuntimeError):
            model.rope(torch.zeros(1, 4, *latent))


def test_generate_writes_videos_and_compares_them(tmp_path):
    results = load_example("generate").main(["--output", str(tmp_path), "--steps", "2", "--device", "cpu"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bf16.mp4", "openvc.mp4", "side_by_side.mp4"]
    assert all(p.stat().st_size > 0 for p in tmp_path.iterdir())
    # Open-VC changes the numerics, so the videos differ, but only slightly.
    assert 30 < results["psnr"] < float("inf")
    assert 0.9 < results["ssim"] < 1.0
    assert results["calls"][("self", "openvc-reference")] > 0


@pytest.mark.parametrize(
    "found, expected",
    [
        (None, "imageio-ffmpeg is not installed (pip install imageio-ffmpeg)"),
        (RuntimeError("No ffmpeg exe could be found.\nInstall ffmpeg on your system"), "imageio-ffmpeg finds no ffmpeg "
         "(No ffmpeg exe could be found.)"),
    ],
)
def test_generate_without_a_video_writer_stops_before_loading(found, expected, monkeypatch):
    if found is None:
        monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)  # import fails
    else:
        import imageio_ffmpeg

        monkeypatch.setattr(imageio_ffmpeg, "get_ffmpeg_exe", lambda: (_ for _ in ()).throw(found))
    with pytest.raises(SystemExit) as exit:
        without_pipeline("generate").main(["--steps", "1"])
    assert exit.value.code == f"Cannot write the videos: {expected}"


def test_generate_prints_its_comparison_before_writing(tmp_path, monkeypatch, capsys):
    script = load_example("generate")

    def failing_export(*_, **__):
        raise OSError("disk full")

    monkeypatch.setattr(script, "export_to_video", failing_export)
    with pytest.raises(OSError, match="disk full"):
        script.main(["--output", str(tmp_path), "--steps", "1", "--device", "cpu"])
    assert "Open-VC vs stock: PSNR " in capsys.readouterr().out


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


@pytest.fixture
def compare_without_lpips():
    """compare.py, with loading LPIPS (its model: the first thing it loads) made to fail the test."""
    script = load_example("compare")
    script.load_lpips = unavailable
    return script


def test_compare_refuses_what_is_not_a_pair_of_videos(tmp_path, capsys, compare_without_lpips):
    main = compare_without_lpips.main
    video = np.zeros((3, 32, 48, 3))
    write_lossless(tmp_path / "video.avi", video)
    write_lossless(tmp_path / "narrow.avi", video[:, :, :32])
    iio.imwrite(tmp_path / "image.png", np.zeros((32, 48, 3), dtype=np.uint8))
    (tmp_path / "notes.mp4").write_text("not a video")
    (tmp_path / "folder").mkdir()

    def error(reference, candidate):
        return argument_error(capsys, main, [str(tmp_path / reference), str(tmp_path / candidate)])

    assert error("missing.mp4", "video.avi") == f"{str(tmp_path / 'missing.mp4')!r}: no such file or folder"
    assert error("video.avi", "notes.mp4").startswith(
        f"{str(tmp_path / 'notes.mp4')!r} is not a video imageio can read (Could not load meta information"
    )
    assert error("image.png", "video.avi") == (
        f"{str(tmp_path / 'image.png')!r} holds a single image (48x32), not a video"
    )
    assert error("video.avi", "narrow.avi") == (
        f"{str(tmp_path / 'video.avi')!r} has frames of 48x32 but {str(tmp_path / 'narrow.avi')!r} of 32x32; "
        "the videos of a pair need the same number and size of frames"
    )
    assert error("video.avi", "folder").startswith("expected two video files or two folders")
    pair = [str(tmp_path / "video.avi")] * 2
    message = argument_error(capsys, main, [*pair, "--device", "gpu"])
    assert message == "argument --device: 'gpu' is not a device; choose from cpu"
    message = argument_error(capsys, main, [*pair, "--output", str(tmp_path / "video.avi")])
    assert message == f"argument --output: {str(tmp_path / 'video.avi')!r} is a file, not a directory"


def test_compare_refuses_videos_of_different_lengths_before_writing(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "lpips", None)
    video = np.zeros((3, 32, 48, 3))
    write_lossless(tmp_path / "three.avi", video)
    write_lossless(tmp_path / "two.avi", video[:2])
    argv = [str(tmp_path / "three.avi"), str(tmp_path / "two.avi"), "--output", str(tmp_path / "out")]
    # An mp4 or avi header does not say how many frames follow: this shows once the videos are read.
    assert argument_error(capsys, load_example("compare").main, argv) == (
        f"{str(tmp_path / 'three.avi')!r} has 3 frames of 48x32 but {str(tmp_path / 'two.avi')!r} has 2 frames of "
        "48x32; the videos of a pair need the same number and size of frames"
    )
    assert not (tmp_path / "out").exists()


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


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--shapes", "32760x"], "argument --shapes: '32760x' is not SxH: tokens x heads, both >= 1, such as 32760x12"),
        (["--shapes", "32760x12,0x4"], "argument --shapes: '0x4' in '32760x12,0x4' is not SxH"),
        (["--shapes", "12"], "argument --shapes: '12' is not SxH"),
        (["--json", "/dev/null/rows.json"], "argument --json: '/dev/null/rows.json' cannot be created: '/dev/null' is"),
    ],
)
def test_bench_attention_refuses_bad_arguments_before_running(argv, expected, capsys, monkeypatch):
    bench = load_example("bench_attention")
    monkeypatch.setattr(torch.cuda, "is_available", unavailable)  # the first thing main does after parsing
    assert argument_error(capsys, bench.main, argv).startswith(expected)


def test_bench_attention_takes_only_capture_files(tmp_path, capsys):
    main = load_example("bench_attention").main
    (tmp_path / "notes.safetensors").write_text("not tensors")
    message = argument_error(capsys, main, ["--inputs", str(tmp_path / "notes.safetensors")])
    assert message.startswith(f"--inputs {tmp_path / 'notes.safetensors'} is not a safetensors file (")
    save_file({"x": torch.zeros(1)}, tmp_path / "other.safetensors")
    message = argument_error(capsys, main, ["--inputs", str(tmp_path / "other.safetensors")])
    assert message.endswith("is not an examples/capture.py file: format None, expected 'openvc-qkv/1'")
    message = argument_error(capsys, main, ["--inputs", str(tmp_path / "other.safetensors"), "--shapes", "128x1"])
    assert message == "--inputs and --shapes do not combine: the captured tensors have their own shapes"


def test_bench_attention_shapes():
    bench = load_example("bench_attention")
    assert bench.parse_args([]).shapes == [(73397, 7), (32760, 12), (75600, 40), (118800, 24)]
    assert bench.parse_args(["--repair"]).shapes == [(73397, 7), (75600, 40)]
    assert bench.parse_args(["--repair", "--shapes", "128x2"]).shapes == [(128, 2)]


def test_bench_attention_rows_with_stand_in_backends(monkeypatch):
    """The benchmark's bookkeeping on the CPU: the reference stands in for the kernel, SDPA for the BF16 peers and
    SDPA on the dequantized inputs for the FP8 ones (cuDNN's with an FP8 output), every call 'takes' 2 ms back to
    back and 3 ms synchronized; inputs Open-VC refuses leave its methods out and keep the others."""
    bench = load_example("bench_attention")
    monkeypatch.setattr(bench, "time_ms", lambda fn, sets, budget_ms=0: (fn(*sets[0]), 2.0)[1])
    monkeypatch.setattr(bench, "time_ms_synced", lambda fn, sets, budget_ms=0: (fn(*sets[0]), 3.0)[1])
    monkeypatch.setattr(bench, "host_ms", lambda fn, sets: (fn(*sets[0]), 0.5)[1])

    def interleaved(fns, sets, timing, budget_ms=0):  # three rounds; the second call 1% slower
        base = 2.0 if timing == "back_to_back" else 3.0
        return [[(fn(*sets[0]), base * (1 + 0.01 * j))[1]] * 3 for j, fn in enumerate(fns)]

    monkeypatch.setattr(bench, "time_interleaved", interleaved)
    for name, stand_in in stand_in_backends(bench).items():
        monkeypatch.setattr(bench, name, stand_in)
    q, k, v = (torch.randn(2, s, 2, 128, dtype=torch.bfloat16) for s in (200, 150, 150))
    row = bench.bench_sets([[q, k, v]], {"seq": 200, "heads": 2, "label": "step0.layer1"})
    assert sorted(row["order"]) == sorted(bench.METHODS) and "errors" not in row
    assert row["ms"]["back_to_back"] == dict.fromkeys(bench.METHODS, 2.0)
    assert row["ms"]["synced"] == dict.fromkeys(bench.METHODS, 3.0)
    assert row["host_ms"] == dict.fromkeys(bench.METHODS, 0.5)
    assert "openvc_prepare" not in row["tflops"]["synced"]  # no attention FLOPs in the preparation
    assert row["tflops"]["back_to_back"]["fa4_bf16"] == pytest.approx(4 * 2 * 200 * 150 * 2 * 128 / 2e-3 / 1e12)
    assert row["tflops"]["synced"]["fa3_fp8_call"] == pytest.approx(4 * 2 * 200 * 150 * 2 * 128 / 3e-3 / 1e12)
    errors = row["rel_l2_vs_float64"]
    assert sorted(errors) == sorted(set(bench.METHODS) - {"openvc_prepare"})
    assert max(errors[name] for name in ("fa4_bf16", "fa3_bf16", "cudnn_bf16")) < 0.01
    for name in ("openvc_kernel", "openvc_api", "openvc_default", "fa3_fp8_prequantized", "fa3_fp8_call"):
        assert 0.02 < errors[name] < 0.08, name  # E4M3's 3-bit mantissa: a few percent, as on the GPU
    assert errors["fa3_fp8_call"] == errors["fa3_fp8_prequantized"]
    assert 0.02 < errors["cudnn_fp8_prequantized"] < 0.1  # its E4M3 output adds to it
    assert 0.04 < row["rel_l2_vs_fa4"] < 0.08
    assert "step0.layer1 | openvc_kernel          |     2.000" in bench.table([row])
    assert row["interleaved"]["synced"]["ms"] == {"openvc_api": 3.0, "openvc_default": pytest.approx(3.03)}
    assert row["interleaved"]["back_to_back"]["defaults_over_api"] == pytest.approx(0.01)
    overheads = bench.overhead_table([row]).splitlines()[1].split()  # apart, interleaved, for each timing
    assert overheads[-7:] == ["+0.00%", "|", "+1.00%", "|", "+0.00%", "|", "+1.00%"]

    def refuse(q, k, v, **options):
        raise ValueError("head_dim must be 128")

    monkeypatch.setattr(bench, "prepare", refuse)
    monkeypatch.setattr(bench, "attention", refuse)
    row = bench.bench_sets([[q, k, v]], {"seq": 200, "heads": 2, "label": "refused"})
    assert sorted(row["errors"]) == ["openvc_api", "openvc_default", "openvc_kernel", "openvc_prepare"]
    assert "openvc_api" not in row["ms"]["synced"] and row["ms"]["synced"]["fa4_bf16"] == 3.0
    assert "openvc_api" not in row["rel_l2_vs_float64"] and "rel_l2_vs_fa4" not in row and "interleaved" not in row
    assert "refused | openvc_api             |    failed" in bench.table([row])

    row = bench.bench_sets([[q, k, v]], {"seq": 200, "heads": 2, "label": "some"}, ["fa4_bf16", "cudnn_bf16"])
    assert sorted(row["order"]) == sorted(row["ms"]["synced"]) == ["cudnn_bf16", "fa4_bf16"]

    def fails_when_synced(fns, sets, timing, budget_ms=0):
        if timing == "synced":
            raise RuntimeError("CUDA out of memory")
        return interleaved(fns, sets, timing)

    monkeypatch.setattr(bench, "time_interleaved", fails_when_synced)
    monkeypatch.setattr(bench, "prepare", stand_in_backends(bench)["prepare"])
    monkeypatch.setattr(bench, "attention", stand_in_backends(bench)["attention"])
    row = bench.bench_sets([[q, k, v]], {"seq": 200, "heads": 2, "label": "oom"}, list(bench.PAIRED))
    assert row["errors"] == {"interleaved": "RuntimeError: CUDA out of memory"} and "interleaved" not in row
    assert row["ms"]["synced"] == dict.fromkeys(bench.PAIRED, 3.0)  # the methods' own timings stay


def stand_in_backends(bench) -> dict:
    """CPU stand-ins, by the name ``bench`` calls them by, for every backend of examples/bench_attention.py."""

    def sdpa(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)

    def fa3_fp8(q8, k8, v8, *descales):  # (B, H) descales, BF16 out
        q, k, v = (x.float() * d[:, None, :, None] for x, d in zip((q8, k8, v8), descales))
        return sdpa(q, k, v).bfloat16()

    class CudnnFp8:  # per-tensor descales; an E4M3 output scaled by o_scale
        def __init__(self, *args):
            self.o_scale = 64.0

        def __call__(self, q8, k8, v8, *descales):
            out = sdpa(*(x.float() * d for x, d in zip((q8, k8, v8), descales)))
            return (out * self.o_scale).to(torch.float8_e4m3fn)

        def dequantize(self, out8):
            return out8.float() / self.o_scale

    return {
        "clocks": lambda: "-",
        "prepare": lambda q, k, v: (q, k, v),
        "attention_prepared": lambda p, out, softmax_scale: out.copy_(reference_attention(*p)),
        "attention": lambda q, k, v, **options: reference_attention(q, k, v, **options),
        "run_fa4": sdpa,
        "run_fa3": sdpa,
        "run_cudnn": sdpa,
        "run_fa3_fp8": fa3_fp8,
        "CudnnFp8Attention": CudnnFp8,
    }


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
