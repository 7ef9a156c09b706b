"""examples/bench_ulysses.py: two gloo processes under torchrun on the tiny Wan, and the launch errors."""

import json
import subprocess
import sys

import pytest
from test_examples import EXAMPLES, argument_error, load_example, unavailable

DEGREE = 2
RANK_KEYS = {"rank", "forward_ms", "forwards_ms", "self_call_ms", "attention_ms", "all_to_all_ms", "calls"}


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))  # as when run as a script: it imports bench_pipeline's constants
    return load_example("bench_ulysses")


def test_help(bench, capsys):
    with pytest.raises(SystemExit) as exit:
        bench.main(["--help"])
    assert exit.value.code == 0
    assert "usage:" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--backends", "openvc,fa5"], "argument --backends: unknown backend 'fa5'; choose from openvc, fa4"),
        (["--backends", "fa4,fa4"], "argument --backends: backend fa4 given more than once in 'fa4,fa4'"),
        (["--heads", "0"], "argument --heads: 0: expected an integer >= 1"),
        (["--iters", "many"], "argument --iters: 'many' is not an integer"),
        (["--size", "1080p"], "argument --size: invalid choice: '1080p'"),
        (["--tiny", "--json", "/dev/null/u.json"], "argument --json: '/dev/null/u.json' cannot be created: '/dev"),
    ],
)
def test_bad_arguments_stop_before_any_process_group(bench, argv, expected, capsys, monkeypatch):
    monkeypatch.setattr(bench, "init_distributed", unavailable)
    assert argument_error(capsys, bench.main, argv).startswith(expected)


def test_tiny_on_two_processes_matches_one(tmp_path):
    path = tmp_path / "bench.json"
    script = EXAMPLES / "bench_ulysses.py"
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(DEGREE), "--standalone"]
    command = [*launch, str(script), "--tiny", "--iters", "2", "--json", str(path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]

    results = json.loads(path.read_text())
    assert (results["meta"]["degree"], results["meta"]["tokens"]) == (DEGREE, 160)
    assert [r["rank"] for r in results["meta"]["ranks"]] == [0, 1]
    # FlashAttention-4 needs CUDA: skipped, with the reason.
    fa4 = results["backends"]["fa4"]
    assert not fa4["available"] and ("flash-attn-4 is not installed" in fa4["reason"] or "CUDA" in fa4["reason"])

    openvc = results["backends"]["openvc"]
    for run in ("single", "ulysses"):
        assert [r["rank"] for r in openvc[run]] == [0, 1]
        for figures in openvc[run]:
            assert RANK_KEYS <= set(figures) and "fallback" not in figures
            # 2 timed forwards x 2 blocks; the warm-up's calls are not counted.
            assert figures["calls"] == {"cross:sdpa": 4, "self:openvc-reference": 4}
            assert len(figures["forwards_ms"]) == 2 and figures["forward_ms"] > 0
            assert 0 < figures["attention_ms"] <= figures["self_call_ms"]
            # Only the P-process run exchanges anything.
            assert (figures["all_to_all_ms"] > 0) == (run == "ulysses")
    for figures in openvc["ulysses"]:
        assert figures["rel_l2_vs_1gpu"] <= 1e-3
    summary = openvc["summary"]
    assert summary["rel_l2_vs_1gpu"] <= 1e-3 and not summary["fallback"]
    assert summary["all_to_all_ms"]["min"] <= summary["all_to_all_ms"]["median"] <= summary["all_to_all_ms"]["max"]
    assert " openvc |  2 |" in done.stdout.splitlines()[-2]  # the table comes last


def test_outside_torchrun_says_how_to_launch(bench, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit, match="torchrun --nproc-per-node 2 examples/bench_ulysses.py --tiny --iters 1"):
        bench.main(["--tiny", "--iters", "1"])


def test_heads_must_divide_among_the_processes(bench, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(SystemExit, match="2 attention heads do not divide among 3 processes"):
        bench.main(["--tiny"])
