"""examples/bench_ring_shards.py: its arguments (CPU) and its table; the GPU run is notes/device_run.sh's ring stage."""

import pytest
import torch
from test_examples import EXAMPLES, argument_error, load_example, unavailable


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))  # as when run as a script: it imports bench_attention's helpers
    return load_example("bench_ring_shards")


def test_defaults(bench):
    args = bench.parse_args([])
    assert args.shapes == [(75600, 40)] and args.shards == [2, 4] and not args.smooth_k


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--shards", "1"], "argument --shards: '1' in '1' is not a shard count: expected integers >= 2"),
        (["--shards", "2,x"], "argument --shards: 'x' in '2,x' is not a shard count"),
        (["--shards", "2,4,2"], "argument --shards: shard count 2 given more than once in '2,4,2'"),
        (["--shapes", "75600x"], "argument --shapes: '75600x' is not SxH: tokens x heads, both >= 1"),
        (["--shapes", "3x2", "--shards", "4"], "--shards 4 is more shards than the 3 keys of the shortest shape"),
        (["--json", "/dev/null/r.json"], "argument --json: '/dev/null/r.json' cannot be created: '/dev/null' is"),
        (["--seed", "x"], "argument --seed: 'x' is not an integer"),
    ],
)
def test_bad_arguments_stop_before_running(bench, argv, expected, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", unavailable)  # the first thing main does after parsing
    assert argument_error(capsys, bench.main, argv).startswith(expected)


def test_table_has_a_row_per_shard_count(bench):
    row = dict(
        label="75600x40", shards=2, ms={"unsplit": 112.0, "shards": 113.5, "merge": 2.25}, ring_over_unsplit=1.03,
        rel_l2_vs_unsplit=0.02, lse_max_diff_vs_unsplit=0.01, rel_l2_vs_float64=0.057, unsplit_rel_l2_vs_float64=0.057,
    )
    lines = bench.table([row, dict(row, shards=4)]).splitlines()
    assert len(lines) == 4 and lines[2].startswith("   75600x40 |  2 |     112.00 |    113.50 |    2.250")
