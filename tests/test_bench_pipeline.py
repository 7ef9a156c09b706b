"""examples/bench_pipeline.py: the --tiny path end to end on the CPU, and the full-size model's shapes."""

import argparse
import importlib
import json
import math

import pytest
import torch
from test_examples import argument_error, load_example, unavailable

pytestmark = pytest.mark.usefixtures("one_thread")

BACKEND_KEYS = {
    "available",
    "s_per_step",
    "steps",
    "attention_share",
    "self_attention_share",
    "peak_memory_gib",
    "calls",
    "speedup_vs_fa4",
    "speedup_vs_sdpa",
    "psnr_vs_sdpa_db",
    "frames_psnr_vs_sdpa_db",
    "frames_ssim_vs_sdpa",
    "psnr_vs_eager_db",
    "warm_up_s",
    "compile",
}
# inductor, the script's compiler, builds C++ for the CPU, too slowly for a test on a 2-core machine; aot_eager
# traces the same graphs (dynamo and AOTAutograd) and runs them on the eager kernels.
COMPILED = ["--compile-backend", "aot_eager"]


def test_help(capsys):
    with pytest.raises(SystemExit) as exit:
        load_example("bench_pipeline").main(["--help"])
    assert exit.value.code == 0
    assert "usage:" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--size", "1080p"], "argument --size: unknown size '1080p'; choose from 480p, 720p"),
        (["--size", "480p,480p"], "argument --size: size 480p given more than once in '480p,480p'"),
        (["--steps", "0"], "argument --steps: 0: expected an integer >= 1"),
        (["--layers", "x"], "argument --layers: 'x' is not an integer"),
        (["--decode-frames", "-1"], "argument --decode-frames: -1: expected an integer >= 0"),
        (["--tiny", "--decode-frames", "3"], "argument --decode-frames: 3 is more than the 2 latent frames of"),
        (["--tiny", "--json", "/dev/null/b.json"], "argument --json: '/dev/null/b.json' cannot be created: '/dev"),
        (["--tiny", "--size", "480p"], "--tiny has its own size and layers"),
        (["--tiny", "--compile", "all"], "argument --compile: invalid choice: 'all'"),
    ],
)
def test_bad_arguments_stop_before_the_model_is_built(argv, expected, capsys):
    bench = load_example("bench_pipeline")
    bench.build_model = unavailable
    assert argument_error(capsys, bench.main, argv).startswith(expected)


def test_tiny_runs_every_backend_and_writes_json(tmp_path, capsys):
    path = tmp_path / "bench.json"
    returned = load_example("bench_pipeline").main(["--tiny", "--cfg", "--steps", "2", "--json", str(path)])
    results = json.loads(path.read_text())
    assert results == json.loads(json.dumps(returned))
    assert {"device", "model", "config", "steps", "cfg", "psnr_on", "clocks_before", "clocks_after"} <= set(
        results["meta"]
    )

    (row,) = results["rows"]
    assert (row["size"], row["tokens"]) == ("tiny", 160)
    assert sorted(row["order"]) == sorted(row["backends"]) == ["openvc", "sdpa"]
    # 2 timed steps x 2 forwards (CFG) x 2 layers; the warm-up step's calls are not counted.
    assert row["backends"]["openvc"]["calls"] == {"cross:sdpa": 8, "self:openvc-reference": 8}
    assert row["backends"]["sdpa"]["calls"] == {"cross:sdpa": 8, "self:sdpa": 8}
    for result in row["backends"].values():
        assert BACKEND_KEYS <= set(result) and "fallback" not in result
        assert len(result["steps"]) == 2 and result["s_per_step"] > 0
        assert 0 < result["self_attention_share"] < result["attention_share"] < 1
    assert row["backends"]["sdpa"]["speedup_vs_sdpa"] == 1
    # Open-VC's numerics change the latents, but only slightly.
    assert 20 < row["backends"]["openvc"]["psnr_vs_sdpa_db"] < math.inf
    assert 20 < row["backends"]["openvc"]["frames_psnr_vs_sdpa_db"] < math.inf  # 5 decoded frames
    assert 0.5 < row["backends"]["openvc"]["frames_ssim_vs_sdpa"] < 1
    assert row["backends"]["sdpa"]["frames_psnr_vs_sdpa_db"] is None
    assert (results["meta"]["modes"], row["mode"], row["backends"]["openvc"]["compile"]) == (["eager"], "eager", None)
    assert "openvc-reference 8" in capsys.readouterr().out.splitlines()[-2]  # the table comes last


@pytest.mark.usefixtures("fresh_dynamo")
def test_tiny_compiled_matches_eager_without_recompiling(tmp_path, capsys):
    path = tmp_path / "bench.json"
    argv = ["--tiny", "--cfg", "--steps", "2", "--compile", "both", *COMPILED, "--json", str(path)]
    results = json.loads(json.dumps(load_example("bench_pipeline").main(argv)))
    assert results == json.loads(path.read_text())
    assert results["meta"]["modes"] == ["eager", "compiled"]
    assert results["meta"]["compile"] == "compile_repeated_blocks(fullgraph=True, backend='aot_eager')"

    eager, compiled = results["rows"]
    assert (eager["mode"], compiled["mode"]) == ("eager", "compiled")
    for name, result in compiled["backends"].items():
        assert BACKEND_KEYS <= set(result) and "fallback" not in result
        # One graph for both blocks and every step: none compiled after the warm-up, no graph break.
        assert result["compile"] == {"backend": "aot_eager", "fullgraph": True, "graph_breaks": 0, "recompiles": 0}
        assert result["warm_up_s"] > 0 and len(result["steps"]) == 2
        # The timer stays out of the graph, so compiled rows time whole steps only.
        assert result["attention_share"] is result["self_attention_share"] is result["steps"][0]["self_ms"] is None
        # apply's pre-hook counts compiled calls as the eager run counts them.
        assert result["calls"] == eager["backends"][name]["calls"]
        # aot_eager runs the eager kernels: float32 round-off at most, far above 100 dB, while code traced for the
        # other backend would be at Open-VC's distance from SDPA, well below.
        assert 100 < result["psnr_vs_eager_db"]
        assert eager["backends"][name]["psnr_vs_eager_db"] is None
    # PSNR against the compiled sdpa run, as eagerly: each compiled run ran its own backend.
    openvc_db = [row["backends"]["openvc"]["psnr_vs_sdpa_db"] for row in (eager, compiled)]
    assert 20 < openvc_db[1] < math.inf and openvc_db[1] == pytest.approx(openvc_db[0], abs=0.1)
    assert compiled["backends"]["sdpa"]["speedup_vs_sdpa"] == 1  # against the sdpa run of the same mode

    table = capsys.readouterr().out.splitlines()[-4:]
    assert [line.split("|")[1:3] for line in table] == [
        ["    eager ", "  openvc "],
        [" compiled ", "  openvc "],
        ["    eager ", "    sdpa "],
        [" compiled ", "    sdpa "],
    ]
    assert table[1].split("|")[4:6] == ["      - ", "      - "]  # attention shares
    assert "RECOMPILED" not in "\n".join(table) and "graph breaks" not in "\n".join(table)


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_graph_compiled_in_the_timed_steps_is_reported(tmp_path, capsys):
    # Without its routes made up front, a processor makes them in the compiled warm-up, and the code traced then
    # (guarded on the modules' earlier routes) is compiled again in the first timed step.
    bench = load_example("bench_pipeline")
    bench.own_routes = lambda model, processor: None
    argv = ["--tiny", "--steps", "2", "--compile", "blocks", *COMPILED, "--decode-frames", "0"]
    (row,) = bench.main([*argv, "--json", str(tmp_path / "bench.json")])["rows"]
    assert all(result["compile"]["recompiles"] > 0 for result in row["backends"].values())
    assert all("RECOMPILED" in line for line in capsys.readouterr().out.splitlines()[-2:])


@pytest.mark.usefixtures("fresh_dynamo")
def test_attention_that_breaks_the_graph_compiles_with_graph_breaks(tmp_path, monkeypatch, capsys):
    # As FA4's CuTe call may: dynamo cannot trace it, so fullgraph fails and the run compiles again without it.
    attention = importlib.import_module("openvc_diffusers.attention")
    run_reference = attention.run_reference

    def untraceable(*args, **kwargs):
        torch._dynamo.graph_break()
        return run_reference(*args, **kwargs)

    monkeypatch.setattr(attention, "run_reference", untraceable)
    argv = ["--tiny", "--steps", "2", "--compile", "blocks", *COMPILED, "--decode-frames", "0"]
    (row,) = load_example("bench_pipeline").main([*argv, "--json", str(tmp_path / "bench.json")])["rows"]
    openvc, sdpa = row["backends"]["openvc"], row["backends"]["sdpa"]
    assert (openvc["compile"]["fullgraph"], openvc["compile"]["recompiles"]) == (False, 0)
    assert openvc["compile"]["graph_breaks"] > 0
    assert openvc["calls"] == {"cross:sdpa": 4, "self:openvc-reference": 4}
    assert 20 < openvc["psnr_vs_sdpa_db"] < math.inf
    assert sdpa["compile"]["fullgraph"] and not sdpa["compile"]["graph_breaks"]
    out = capsys.readouterr().out
    assert "openvc: no full graph" in out and "graph breaks" in out.splitlines()[-2]


@pytest.mark.parametrize("single_block_14b", [False, True])
def test_full_size_model_has_wan_shapes(single_block_14b):
    bench = load_example("bench_pipeline")
    args = argparse.Namespace(tiny=False, single_block_14b=single_block_14b, layers=None, seed=0)
    model = bench.build_model(args, "meta")  # shapes only: nothing allocated
    heads, dim, layers = (40, 5120, 1) if single_block_14b else (12, 1536, 30)
    block = model.blocks[0]
    assert (len(model.blocks), block.attn1.heads, block.attn1.to_q.weight.shape[0]) == (layers, heads, dim)
    # bfloat16 as from_pretrained loads it: the modules Wan keeps in float32 stay float32.
    assert (block.attn1.to_q.weight.dtype, block.norm2.weight.dtype) == (torch.bfloat16, torch.float32)
    assert [bench.tokens(model, latent) for latent in bench.SIZES.values()] == [32_760, 75_600]
    if not single_block_14b:
        # 1.42B: Wan2.1-T2V-1.3B's transformer, 2.84 GB in bfloat16.
        assert sum(p.numel() for p in model.parameters()) == 1_418_996_800


def test_clocks_without_nvidia_smi_are_empty(monkeypatch):
    # The benchmarks record clocks on every run; a machine without nvidia-smi (the CPU runs) records nothing.
    from openvc_diffusers import gpu_state

    monkeypatch.setattr(gpu_state, "CLOCKS_QUERY", ["no-such-program-openvc"])
    assert gpu_state.clocks() == ""


def test_seconds_per_step_weighs_alternating_steps_alike():
    bench = load_example("bench_pipeline")
    # Steps that alternate fast, slow, fast, ...: the plain median of five is the fast time.
    assert bench.seconds_per_step([400.0, 430.0, 400.0, 430.0, 400.0]) == pytest.approx(0.415)
    assert bench.seconds_per_step([430.0, 400.0, 430.0, 400.0, 430.0]) == pytest.approx(0.415)
    assert bench.seconds_per_step([400.0, 430.0, 900.0, 420.0, 410.0]) == pytest.approx(0.4175)  # one outlier
    assert bench.seconds_per_step([500.0]) == pytest.approx(0.5)
    assert bench.seconds_per_step([500.0, 520.0]) == pytest.approx(0.51)
