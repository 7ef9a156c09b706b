"""examples/bench_attention.py on the CPU: the peers' FP8 quantization, the report of missing packages, the table
and main's JSON (tests/test_examples.py runs its rows on stand-in backends)."""

import json
import math
import time
import types

import pytest
import torch
from test_examples import load_example

from openvc_diffusers.config import OpenVCConfig

METHODS = load_example("bench_attention").METHODS

@pytest.fixture
def bench():
    return load_example("bench_attention")


def heads_of_different_sizes(batch=2, seq=64, heads=3) -> torch.Tensor:
    scale = torch.tensor([0.01, 1.0, 300.0])[:heads]
    return (torch.randn(batch, seq, heads, 128) * scale[:, None]).bfloat16()


def test_per_head_quantization_matches_a_loop_over_heads(bench):
    x = heads_of_different_sizes()
    x8, descale = bench.quantize_per_head(x)
    assert x8.dtype == torch.float8_e4m3fn and x8.shape == x.shape
    assert descale.dtype == torch.float32 and descale.shape == (2, 3)  # (B, H), as FA3's descales
    for b in range(2):
        for h in range(3):
            head = x[b, :, h].float()
            assert descale[b, h] == head.abs().max() / 448  # each head's absmax maps to E4M3's largest value
            codes = x8[b, :, h].float()
            assert codes.abs().max() == 448
            # E4M3's 3 fraction bits: at most half a step of 2^-3 relative (of 2^-9 below 2^-6, subnormal)
            step = torch.maximum(codes.abs() * 2.0**-3, torch.tensor(2.0**-9))
            assert ((codes - head / descale[b, h]).abs() <= step / 2 * (1 + 1e-5)).all()


def test_per_tensor_quantization_has_one_scale(bench):
    x = heads_of_different_sizes()
    x8, descale = bench.quantize_per_tensor(x)
    assert descale.shape == (1, 1, 1, 1) and descale == x.float().abs().max() / 448
    assert x8.float().abs().max() == 448
    assert x8[:, :, 0].float().abs().max() < 1  # the small head, scaled with the large one, keeps few codes


def test_quantization_of_a_zero_head_stays_finite(bench):
    x = heads_of_different_sizes()
    x[:, :, 0] = 0
    x8, descale = bench.quantize_per_head(x)
    assert torch.isfinite(x8.float()).all() and (x8[:, :, 0].float() == 0).all() and (descale > 0).all()


def test_fa3_fp8_inputs_are_in_the_call_order(bench):
    q, k, v = (heads_of_different_sizes() * s for s in (1, 2, 4))
    q8, k8, v8, q_descale, k_descale, v_descale = bench.fa3_fp8_inputs(q, k, v)
    for x, x8, descale in ((q, q8, q_descale), (k, k8, k_descale), (v, v8, v_descale)):
        expected8, expected_descale = bench.quantize_per_head(x)
        assert torch.equal(x8.float(), expected8.float()) and torch.equal(descale, expected_descale)
    assert [x.shape for x in bench.cudnn_fp8_inputs(q, k, v)[3:]] == [(1, 1, 1, 1)] * 3


def test_missing_packages_are_reported_and_their_methods_left_out(bench, monkeypatch, capsys):
    monkeypatch.setitem(bench.PEER_PACKAGES, "no_such_module", ("no-such-package", "pip install no-such-package"))
    monkeypatch.setattr(bench, "PEER_MODULES", {"fa3_bf16": "no_such_module", "fa3_fp8_call": "no_such_module"})
    methods, unavailable = bench.available_methods()
    assert methods == [name for name in METHODS if name not in ("fa3_bf16", "fa3_fp8_call")]
    expected = (
        "no-such-package does not import (ModuleNotFoundError: No module named 'no_such_module'); "
        "pip install no-such-package"
    )
    assert unavailable == {"fa3_bf16": expected, "fa3_fp8_call": expected}
    bench.report_unavailable(unavailable)
    assert capsys.readouterr().out == f"unavailable, left out: fa3_bf16, fa3_fp8_call: {expected}\n"


def test_a_package_whose_library_does_not_load_is_unavailable(bench, monkeypatch):
    def broken(name):
        raise OSError("libcudnn.so.9: cannot open shared object file")

    monkeypatch.setattr(bench.importlib, "import_module", broken)
    with pytest.raises(bench.Unavailable, match=r"^nvidia-cudnn-frontend does not import \(OSError: libcudnn"):
        bench.peer("cudnn")


def test_every_peer_names_its_package(bench):
    assert set(bench.PEER_MODULES) <= set(METHODS)
    assert set(bench.PEER_MODULES.values()) == set(bench.PEER_PACKAGES)
    assert bench.peer_versions().keys() == {"flash-attn-4", "fa3-fwd", "nvidia-cudnn-frontend"}


def fake_row(label="32760x12", failed=(), left_out=()) -> dict:
    """A bench_sets row: every method 10 ms back to back and 11 ms synchronized, FA4 20 and 22 ms; 0.5 ms of host
    time per call."""
    order = [name for name in METHODS if name not in left_out]
    ms = {name: 20.0 if name == "fa4_bf16" else 10.0 for name in order if name not in failed}
    row = {"label": label, "order": order, "errors": {name: "ValueError: no" for name in failed}}
    row["ms"] = {"back_to_back": ms, "synced": {name: t * 1.1 for name, t in ms.items()}}
    row["tflops"] = {
        timing: {name: 5000 / t for name, t in times.items() if name != "openvc_prepare"}
        for timing, times in row["ms"].items()
    }
    row["rel_l2_vs_float64"] = {name: 0.05 for name in ms if name != "openvc_prepare"}
    row["host_ms"] = dict.fromkeys(ms, 0.5)
    return row


def test_table_has_a_line_per_shape_and_method(bench):
    rows = [fake_row(), fake_row("step12.layer29", failed=["cudnn_fp8_prequantized"], left_out=["fa3_bf16"])]
    lines = bench.table(rows).splitlines()
    assert len(lines) == 2 + len(METHODS) * 2 - 1 and max(map(len, lines)) <= 120
    assert lines[0].split() == (
        "S x H | method | ms b2b TFLOP/s x FA4 | ms synced TFLOP/s x FA4 | host ms | L2 vs f64".split()
    )
    by_method = {tuple(line.split(" | ")[:2]): line for line in lines[2:]}
    default = by_method["      32760x12", "openvc_default        "]
    assert default.split(" | ")[2:] == ["   10.000     500  2.00", "   11.000     455  2.00", "  0.500", "   0.0500"]
    prepare = by_method["      32760x12", "openvc_prepare        "]
    assert prepare.endswith("|    10.000               |    11.000               |   0.500 |")
    failed = by_method["step12.layer29", "cudnn_fp8_prequantized"]
    assert failed.split(" | ")[2:] == ["   failed              ", "   failed              ", "       ", "   failed"]
    assert ("step12.layer29", "fa3_bf16              ") not in by_method


class FakeEvent:
    """torch.cuda.Event on the CPU: records the time of a clock that the stand-in calls advance."""

    clock = 0.0

    def __init__(self, enable_timing=False):
        self.at = None

    def record(self):
        self.at = FakeEvent.clock

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return end.at - self.at


@pytest.mark.parametrize("timing", ["back_to_back", "synced"])
@pytest.mark.parametrize("budget_ms, expected_rounds", [(40.0, 20), (16.0, 15)])  # 1 ms a call; else MIN_ROUNDS
def test_interleaved_calls_take_turns_and_pair_by_round(bench, monkeypatch, timing, budget_ms, expected_rounds):
    calls, syncs = [], []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: syncs.append(len(calls)))

    def method(name, ms):
        def call(x):
            calls.append((name, x))
            FakeEvent.clock += ms + 0.01 * len(calls)  # each call a little slower: rounds differ

        return call

    methods = [method("api", 1.0), method("defaults", 3.0)]
    times = bench.time_interleaved(methods, [["set0"], ["set1"]], timing, budget_ms)
    timed = calls[3:]  # after calls_for's two calls of the first and one warm-up call of the second
    rounds = len(timed) // 2
    assert bench.MIN_ROUNDS == 15
    assert rounds == expected_rounds and len(times[0]) == len(times[1]) == rounds
    for i in range(rounds):
        pair = timed[2 * i : 2 * i + 2]
        assert [name for name, _ in pair] == (["api", "defaults"] if i % 2 == 0 else ["defaults", "api"])
        assert {x for _, x in pair} == {f"set{i % 2}"}
        n_api = 3 + 2 * i + (1 if i % 2 == 0 else 2)  # the api call's number among all calls
        assert times[0][i] == pytest.approx(1.0 + 0.01 * n_api)
        assert times[1][i] == pytest.approx(3.0 + 0.01 * (n_api + (1 if i % 2 == 0 else -1)))
    synced_before = [n for n in syncs if n >= 3]
    if timing == "synced":
        assert synced_before == list(range(3, 3 + 2 * rounds)) + [3 + 2 * rounds]  # before each call, then once
    else:
        assert synced_before == [3 + 2 * rounds]


def test_overhead_table_compares_apart_and_interleaved(bench):
    plain, paired = fake_row("73397x7"), fake_row()
    paired["ms"]["synced"]["openvc_default"] = 11.0 * 1.035
    paired["interleaved"] = {
        "back_to_back": {"ms": {}, "defaults_over_api": 0.0152},
        "synced": {"ms": {}, "defaults_over_api": 0.0161},
    }
    assert bench.overhead_table([plain]) == ""
    lines = bench.overhead_table([plain, paired]).splitlines()
    assert len(lines) == 2 and "synced interleaved" in lines[0]
    assert lines[1].split() == ["32760x12", "|", "+0.00%", "|", "+1.52%", "|", "+3.50%", "|", "+1.61%"]


def test_main_writes_meta_and_rows_and_prints_the_table_last(bench, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "stand-in GPU")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bench, "clocks", lambda: "-")
    unavailable = {"cudnn_fp8_prequantized": "nvidia-cudnn-frontend does not import (...); pip install ..."}
    methods = [name for name in METHODS if name not in unavailable]
    monkeypatch.setattr(bench, "available_methods", lambda: (methods, unavailable))
    run = []
    monkeypatch.setattr(bench, "bench_shape", lambda seq, heads, m: run.append(m) or fake_row(f"{seq}x{heads}"))

    path = tmp_path / "bench.json"
    rows = bench.main(["--shapes", "128x2,256x1", "--json", str(path)])
    assert run == [methods, methods] and [r["label"] for r in rows] == ["128x2", "256x1"]
    written = json.loads(path.read_text())
    assert written["rows"] == rows and written["meta"]["unavailable"] == unavailable
    assert written["meta"]["openvc_default_options"] == OpenVCConfig().kernel_options
    out = capsys.readouterr().out.splitlines()
    assert f"unavailable, left out: cudnn_fp8_prequantized: {unavailable['cudnn_fp8_prequantized']}" in out
    assert out[-1].startswith("      256x1 | cudnn_bf16")


def test_help_lists_every_method(bench, capsys):
    with pytest.raises(SystemExit) as exit:
        bench.main(["--help"])
    assert exit.value.code == 0
    out = capsys.readouterr().out
    assert all(f"    {name} " in out for name in METHODS)


class FakeCudnnGraph:
    """cudnn.pygraph's calls that CudnnFp8Attention makes; ``execute`` computes SDPA on the dequantized inputs
    in float32 and writes O * scale_o in E4M3, as cuDNN's FP8 SDPA with an FP8 output does."""

    class Tensor:
        def __init__(self, name, dim=None, stride=None, data_type=None):
            self.name, self.dim, self.stride, self.data_type, self.output = name, dim, stride, data_type, False

        def set_output(self, output):
            self.output = output
            return self

        def set_dim(self, dim):
            self.dim = dim
            return self

        def set_stride(self, stride):
            self.stride = stride
            return self

        def set_data_type(self, data_type):
            self.data_type = data_type
            return self

    def __init__(self, **options):
        self.options, self.steps = options, []

    def tensor(self, **attributes):
        return self.Tensor(**attributes)

    def sdpa_fp8(self, *, generate_stats, attn_scale, **ports):
        self.ports, self.attn_scale = ports, attn_scale
        self.o, self.amax_s, self.amax_o = (self.Tensor(name) for name in ("O", "Amax_S", "Amax_O"))
        return self.o, None, self.amax_s, self.amax_o

    def __getattr__(self, step):  # validate, build_operation_graph, ...: recorded, in order
        return lambda *args: self.steps.append(step)

    def get_workspace_size(self):
        return 16

    def execute(self, pack, workspace, handle):
        assert set(pack) == {*self.ports.values(), self.o, self.amax_s, self.amax_o}
        assert all(t.output for t in (self.o, self.amax_s, self.amax_o))
        data = {name: pack[t] for name, t in self.ports.items()}
        # cuDNN's (B, H, S, D) view, by each tensor's dims and strides, over the buffers handed in
        q, k, v = (torch.as_strided(data[x], self.ports[x].dim, self.ports[x].stride) for x in "qkv")
        q, k, v = (x.float() * data[f"descale_{name}"] for x, name in zip((q, k, v), "qkv"))
        assert data["scale_s"] * data["descale_s"] == 1
        o = torch.softmax(q @ k.transpose(-1, -2) * self.attn_scale, dim=-1) @ v
        torch.as_strided(pack[self.o], self.o.dim, self.o.stride).copy_((o * data["scale_o"]).to(torch.float8_e4m3fn))


def test_cudnn_fp8_graph_binds_every_tensor_and_scales_its_output(bench, monkeypatch):
    fake = types.SimpleNamespace(
        create_handle=lambda: "handle",
        destroy_handle=lambda handle: None,
        set_stream=lambda handle, stream: None,
        data_type=types.SimpleNamespace(FP8_E4M3="e4m3", FLOAT="float"),
        heur_mode=types.SimpleNamespace(A="A", FALLBACK="FALLBACK"),
        pygraph=FakeCudnnGraph,
    )
    monkeypatch.setattr(bench, "peer", lambda module: fake)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=0))
    q, k, v = (torch.randn(1, s, 2, 128).bfloat16() * scale for s, scale in ((96, 1), (80, 1), (80, 30)))
    setup = bench.cudnn_fp8_setup([[q, k, v]])
    sdpa = setup.call
    steps = ["validate", "build_operation_graph", "create_execution_plans", "check_support", "build_plans"]
    assert sdpa.graph.steps == steps
    assert sdpa.graph.options["io_data_type"] == "e4m3" and sdpa.graph.options["handle"] == "handle"
    out8 = sdpa(*setup.arg_sets[0])
    assert out8.dtype == torch.float8_e4m3fn and out8.shape == q.shape
    scale = sdpa.o_scale.item()
    assert scale == 2.0 ** round(math.log2(scale)) and 112 < out8.float().abs().max() <= 224
    exact = torch.nn.functional.scaled_dot_product_attention(*(x.double().transpose(1, 2) for x in (q, k, v)))
    assert 0.02 < bench.rel_l2(setup.output(out8), exact.transpose(1, 2)) < 0.1


def test_host_time_is_the_hosts_time_per_call(bench, monkeypatch):
    """The calls are timed on the host's clock between two synchronizes (no GPU here: they do nothing)."""
    synchronized = []
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: synchronized.append(len(calls)))
    calls = []

    def call(x):
        calls.append(x)
        time.sleep(0.002)

    assert 2.0 <= bench.host_ms(call, [[1], [2]]) < 20.0
    assert calls == [1, 2] * (bench.HOST_CALLS // 2) and synchronized == [0, bench.HOST_CALLS]
