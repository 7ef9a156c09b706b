"""The sm90 kernel against the bit-faithful reference, on a Hopper GPU (skipped elsewhere)."""

import pytest
import torch

from openvc_kernels import compile_cache
from openvc_kernels.ops import attention, attention_prepared, prepare, sm_count
from openvc_kernels.quant import BLOCK, num_blocks
from openvc_kernels.split import plan_tail_split
from openvc_kernels.preparation import Prepared, prepare_reference, with_whole_repair_tiles
from openvc_kernels.reference import reference_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
        reason="needs a Hopper GPU",
    ),
]

REL_L2 = 1e-3
"""Against the reference that adds up Q8 . K8 and P . V8 as the FP8 wgmma does (``accumulation="wgmma"``):
what is left is FP32 order and the MUFU exponential of the rescale, which flip a few BF16 roundings."""
REL_L2_EXACT_SUMS = 1e-2
"""Against the reference with exact FP32 sums: the wgmma keeps ~14 significant bits, so a few codes sit one
step away (measured rel-L2 2.4e-3 .. 4.8e-3 on N(0, 1) inputs, S = 127 .. 32760)."""
EXACT_CHANNELS = 8


def _rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _assert_matches(out: torch.Tensor, q, k, v, **options) -> None:
    """rel-L2 <= REL_L2 against the wgmma-summing reference, which splits the last wave as the kernel does on
    this GPU unless ``sm_count`` says otherwise; the message says how the BF16 outputs differ."""
    options.setdefault("sm_count", sm_count(q.device))
    ref = reference_attention(q, k, v, accumulation="wgmma", **options)
    torch.cuda.synchronize()
    rel = _rel_l2(out, ref)
    differ = out != ref
    ulp = torch.finfo(torch.bfloat16).eps * ref.float().abs().clamp(min=2.0**-126)
    ulps = ((out.float() - ref.float()).abs() / ulp).max().item()
    share = differ.float().mean().item()
    assert rel <= REL_L2, f"rel-L2 {rel:.3g}; {share:.3%} of the outputs differ, by at most {ulps:.0f} ulp"


def _inputs(batch, s_q, s_k, heads, dtype=torch.bfloat16):
    # Fresh random inputs on every call: no seed.
    q = torch.randn(batch, s_q, heads, 128, device="cuda", dtype=dtype)
    k = torch.randn(batch, s_k, heads, 128, device="cuda", dtype=dtype)
    v = torch.randn(batch, s_k, heads, 128, device="cuda", dtype=dtype)
    return q, k, v


def _exact_score_inputs(batch, s_q, s_k, heads):
    """q, k in {-1, 0, 1} on 8 channels, every 128-token block holding a 1: Q8 . K8 is a small multiple
    of 448^2, exact however the FP8 wgmma accumulates, so the kernel's codes must equal the reference's."""

    def ternary(seq):
        x = torch.zeros(batch, seq, heads, 128, device="cuda")
        x[..., :EXACT_CHANNELS] = torch.randint(-1, 2, (batch, seq, heads, EXACT_CHANNELS), device="cuda").float()
        x[:, ::128, :, 0] = 1.0
        return x.bfloat16()

    return ternary(s_q), ternary(s_k), torch.randn(batch, s_k, heads, 128, device="cuda", dtype=torch.bfloat16)


def _run_poisoned(q, k, v, window=4, split_tail=True) -> torch.Tensor:
    """The forward kernel, on the PyTorch preparation, into a NaN-filled output: every element must be written."""
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device=q.device)
    prepared = prepare_reference(q, k, v)
    attention_prepared(prepared, out, softmax_scale=q.shape[-1] ** -0.5, window=window, split_tail=split_tail)
    torch.cuda.synchronize()
    assert not out.isnan().any(), "output elements left unwritten"
    return out


@pytest.mark.parametrize(
    "batch,seq,heads",
    [
        (1, 1, 1),
        (1, 127, 1),
        (1, 128, 12),
        (2, 129, 1),
        (2, 1000, 12),
        (1, 4096, 12),
        (2, 4096, 1),
        (1, 32760, 12),
        (1, 75600, 1),
    ],
)
def test_matches_reference_on_exact_scores(batch, seq, heads):
    q, k, v = _exact_score_inputs(batch, seq, seq, heads)
    _assert_matches(_run_poisoned(q, k, v), q, k, v)


@pytest.mark.parametrize(
    "batch,seq,heads",
    [(1, 1, 1), (2, 127, 1), (1, 128, 12), (2, 129, 12), (1, 4096, 12), (2, 4096, 1), (1, 32760, 1), (1, 75600, 1)],
)
def test_matches_reference_on_random_inputs(batch, seq, heads):
    q, k, v = _inputs(batch, seq, seq, heads)
    out = _run_poisoned(q, k, v)
    _assert_matches(out, q, k, v)
    assert _rel_l2(out, reference_attention(q, k, v, sm_count=sm_count(q.device))) <= REL_L2_EXACT_SUMS


@pytest.mark.parametrize(
    "batch,seq,heads,window", [(2, 4096, 1, 4), (2, 4096, 1, None), (1, 6144, 3, 4), (1, 2500, 2, 4)]
)
def test_tail_split_matches_reference(batch, seq, heads, window):
    """On an H200: every unit in 2 pieces of 16 tiles; the last 12 units in 3 pieces of 16; 40 units whose pieces
    would be too short (none split); the first also in plain order. 32,760 x 12 (3 pieces of 85) runs in
    test_matches_reference_on_exact_scores.
    The merged output against the reference that splits alike, the unsplit kernel against the one that does not,
    and repeated split calls bitwise identical (pieces merge in order, whichever finishes last)."""
    q, k, v = _inputs(batch, seq, seq, heads)
    units, key_tiles = batch * heads * num_blocks(seq), num_blocks(seq)
    split = _run_poisoned(q, k, v, window)
    _assert_matches(split, q, k, v, window=window)
    _assert_matches(_run_poisoned(q, k, v, window, split_tail=False), q, k, v, window=window, sm_count=None)
    if plan_tail_split(units, key_tiles, sm_count(q.device)).splits > 1:
        for _ in range(3):
            assert torch.equal(_run_poisoned(q, k, v, window), split)


@pytest.mark.parametrize("window", [4, None])
def test_tail_split_with_repair_matches_reference(window):
    """On an H200 every unit of 2 x 4096 x 1 runs in 2 pieces, each keeping the repair keys of the tokens it
    visited (V with outliers, so those keys weigh): against the reference that splits alike, and repeated calls
    bitwise identical."""
    q, k, v = _inputs(2, 4096, 4096, 1)
    v = _outlier_values(v)
    if plan_tail_split(2 * num_blocks(4096), num_blocks(4096), sm_count(q.device)).splits < 2:
        pytest.skip("this GPU's SM count does not split these units")
    out = attention(q, k, v, repair_ratio=0.02, window=window)
    _assert_matches(out, q, k, v, repair_ratio=0.02, window=window)
    for _ in range(2):
        assert torch.equal(attention(q, k, v, repair_ratio=0.02, window=window), out)


@pytest.mark.parametrize(
    "batch,seq,heads,ratio,window",
    [(1, 32760, 12, 0.005, 4), (2, 4100, 3, 0.01, 4), (2, 4096, 1, 0.005, None), (1, 6144, 3, 0.01, 4)],
)
def test_a_half_repair_tile_gives_the_bytes_of_a_whole_one(batch, seq, heads, ratio, window):
    """A last repair tile of 64 keys (an n64 QK^T, PV over two k-blocks) against the same keys with 64 zero keys
    more, in a whole tile: the same output bytes, whole units and split ones (2 x 4096 x 1 splits on an H200), with
    and without whole repair tiles before it (164 keys: one and a half tiles; 41 and 20: half a tile)."""
    q, k, v = _inputs(batch, seq, seq, heads)
    v = _outlier_values(v)
    prepared = prepare(q, k, v, repair_ratio=ratio)
    assert prepared.d_k_repair.shape[-1] % BLOCK == BLOCK // 2
    outputs = []
    for p in (prepared, with_whole_repair_tiles(prepared)):
        out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device=q.device)
        outputs.append(attention_prepared(p, out, softmax_scale=128**-0.5, window=window))
    torch.cuda.synchronize()
    assert not outputs[0].isnan().any(), "output elements left unwritten"
    assert torch.equal(outputs[0], outputs[1])
    _assert_matches(outputs[0], q, k, v, repair_ratio=ratio, window=window)


@pytest.mark.parametrize("window", [None, 0, 1, 4, 100])
def test_visiting_orders(window):
    q, k, v = _exact_score_inputs(1, 1500, 1500, 2)
    _assert_matches(_run_poisoned(q, k, v, window), q, k, v, window=window)


def test_fp16_and_cross_lengths():
    q, k, v = (x.half() for x in _exact_score_inputs(2, 300, 777, 3))
    _assert_matches(attention(q, k, v, softmax_scale=0.1), q, k, v, softmax_scale=0.1)


def test_repeated_calls_are_bitwise_identical():
    q, k, v = _inputs(1, 4096, 4096, 12)
    first = attention(q, k, v)
    for _ in range(3):
        assert torch.equal(attention(q, k, v), first)


def test_rejects_bad_inputs():
    q, k, v = _inputs(1, 128, 128, 1)
    with pytest.raises(ValueError, match="head_dim"):
        attention(q[..., :64], k[..., :64], v[..., :64])
    with pytest.raises(ValueError, match="float32"):
        attention(q.float(), k.float(), v.float())
    assert isinstance(prepare(q, k, v), Prepared)


def test_complete_call_matches_reference():
    """The fused preparation plus the kernel, through the public entry point."""
    q, k, v = _inputs(2, 4100, 4100, 3)
    _assert_matches(attention(q, k, v), q, k, v)


def test_cuda_graph_replay_after_inputs_change():
    q, k, v = _inputs(1, 4100, 4100, 2)  # 66 units on 132 SMs: split in two, counters zeroed on every replay
    attention(q, k, v)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = attention(q, k, v)
    for x in (q, k, v):
        x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(static_out, attention(q, k, v))


def test_torch_compile_traces_the_custom_op():
    q, k, v = _inputs(1, 2000, 2000, 2)
    compiled = torch.compile(lambda q, k, v: attention(q, k, v).float() * 2, fullgraph=True)
    assert torch.equal(compiled(q, k, v), attention(q, k, v).float() * 2)


def test_smooth_k_matches_reference():
    q, k, v = _inputs(1, 2000, 2000, 2)
    k[..., :4] += 20.0
    _assert_matches(attention(q, k, v, smooth_k=True), q, k, v, smooth_k=True)


def test_kernels_loaded_from_the_disk_cache_give_the_same_bytes(tmp_path, monkeypatch):
    """A new process (an empty in-memory cache) loads the object files the first one wrote, and they run."""
    monkeypatch.setenv(compile_cache.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(compile_cache, "_loaded", {})
    q, k, v = _inputs(2, 1000, 1000, 3)
    compiled = attention(q, k, v)
    # The forward kernel and the preparation's (Q's and K's quantization, V's absmax, pack V, the descale guards).
    assert sorted(tmp_path.glob("*.o")) == sorted(compile_cache.kernel_path(name) for name in compile_cache._loaded)
    assert len(compile_cache._loaded) == 6
    compile_cache._loaded.clear()
    loaded = attention(q, k, v)
    assert all(type(kernel).__name__ == "Function" for kernel in compile_cache._loaded.values())
    assert torch.equal(loaded, compiled)


def _outlier_values(v: torch.Tensor, share: float = 0.005, factor: float = 20.0) -> torch.Tensor:
    """V with ``share`` of its tokens scaled up: their heads' FP8 scale grows, the other tokens lose bits."""
    tokens = torch.randperm(v.shape[1], device=v.device)[: max(1, int(share * v.shape[1]))]
    v = v.clone()
    v[:, tokens] *= factor
    return v


@pytest.mark.parametrize("ranking", ["attention", "energy"])
def test_repair_matches_reference(ranking):
    q, k, v = _inputs(2, 4100, 4100, 3)
    v = _outlier_values(v)
    out = attention(q, k, v, repair_ratio=0.01, repair_ranking=ranking)
    _assert_matches(out, q, k, v, repair_ratio=0.01, repair_ranking=ranking)
    assert torch.equal(attention(q, k, v, repair_ratio=0.0), attention(q, k, v))  # rho = 0: no repair at all


def test_repair_of_exact_values_changes_nothing():
    """V that FP8 holds exactly has zero residuals: the repair keys add zeros to the numerator and nothing to the
    denominator, and do not move the max, so the output is bitwise the output without repair."""
    q, k, _ = _inputs(1, 3000, 3000, 4)
    v = (torch.randn(1, 3000, 4, 128, device="cuda") * 100).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    v[0, 0, :, 0] = 448.0
    v = (v * 2.0**-5).bfloat16()
    assert torch.equal(attention(q, k, v, repair_ratio=0.05), attention(q, k, v))


def test_repair_lowers_the_error_on_outlier_values():
    q, k, v = _inputs(1, 8192, 8192, 4)
    v = _outlier_values(v)
    rows = torch.randint(0, 8192, (256,), device="cuda")

    def error(out):
        exact = torch.softmax(q[0, rows].transpose(0, 1).double() @ k[0].permute(1, 2, 0).double() / 128**0.5, -1)
        ref = (exact @ v[0].transpose(0, 1).double()).transpose(0, 1)
        return _rel_l2(out[0, rows].double(), ref)

    plain, repaired = error(attention(q, k, v)), error(attention(q, k, v, repair_ratio=0.005))
    assert repaired < 0.97 * plain, f"rel-L2 vs float64: {repaired:.4f} with repair, {plain:.4f} without"


def test_repair_on_rows_whose_scores_are_all_negative():
    """Rows whose best score is about -0.65 nats: their anchors are 126..128 (94% of rows at 127), where the zero
    keys padding the last repair tile (score 0) would encode to byte 127, E4M3's NaN, unless codes are clamped."""
    q = 0.05 * torch.randn(1, 2000, 2, 128, device="cuda")
    q[..., 0] = 1.0
    k = torch.randn(1, 2000, 2, 128, device="cuda")
    k[..., 0] = -9.3  # q . k / sqrt(128) ~ -0.8 on every pair: anchors 126..128
    v = torch.randn(1, 2000, 2, 128, device="cuda")
    q, k, v = (x.bfloat16() for x in (q, k, v))
    out = attention(q, k, v, repair_ratio=0.01)
    assert out.isfinite().all()
    _assert_matches(out, q, k, v, repair_ratio=0.01)


GRID_LENGTHS = (1, 127, 128, 129, 256, 1000)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("s_q", GRID_LENGTHS)
def test_grid_of_batches_lengths_heads_and_options(batch, s_q):
    # tests/test_inputs.py's grid on the kernel: every key length for this query length, heads, dtypes and
    # options cycling; the batch rows never mix (the second alone gives its rows bit for bit).
    options_cycle = ({}, {"smooth_k": True}, {"repair_ratio": 0.05}, {"repair_ratio": 0.05, "smooth_k": True})
    for index, s_k in enumerate(GRID_LENGTHS):
        heads, dtype = (1, 3)[index % 2], (torch.float16, torch.bfloat16)[index // 2 % 2]
        options = options_cycle[(index + s_q) % 4]
        q, k, v = _inputs(batch, s_q, s_k, heads, dtype)
        out = attention(q, k, v, **options)
        _assert_matches(out, q, k, v, **options)
        if batch == 2:
            assert torch.equal(out[1:], attention(q[1:], k[1:], v[1:], **options))


@pytest.mark.parametrize("tensor", ["q", "k", "v"])
@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_a_non_finite_value_makes_its_head_nan_and_leaves_the_others(tensor, value):
    inputs = dict(zip("qkv", _inputs(2, 1000, 1000, 3)))
    options = {"repair_ratio": 0.01, "smooth_k": True}
    clean = attention(**inputs, **options)
    batch, head = 1, 2
    inputs[tensor][batch, int(torch.randint(1000, ())), head, int(torch.randint(128, ()))] = value
    # NaN in the output where the absmax, hence a descale, is not finite: the preparation's maxima keep NaN.
    hit = torch.zeros(2, 3, dtype=torch.bool, device="cuda")
    hit[batch, head] = True
    assert torch.equal(prepare(**inputs, **options).d_v.isnan(), hit)
    out = attention(**inputs, **options)
    assert out[batch, :, head].isnan().all()
    assert torch.equal(out.transpose(1, 2)[~hit], clean.transpose(1, 2)[~hit])


@pytest.mark.parametrize("factor", [5e7, 1e30])
def test_huge_finite_logits_give_a_weighted_average_of_values(factor):
    q, k, v = _inputs(1, 2000, 2000, 2)
    q = (q.float() * factor).clamp(-3e38, 3e38).bfloat16()
    out = attention(q, k, v).float()
    assert torch.isfinite(out).all()
    low, high = v.float().amin(dim=1, keepdim=True), v.float().amax(dim=1, keepdim=True)
    slack = 0.07 * v.float().abs().amax(dim=1, keepdim=True)
    assert ((out >= low - slack) & (out <= high + slack)).all()
    assert torch.equal(prepare(q, k, v).d_q, prepare_reference(q, k, v).d_q)  # the same code span limit


@pytest.mark.parametrize("return_lse", [False, True])
def test_a_call_through_the_op_gives_the_bits_of_its_body_run_directly(return_lse):
    """An eager call runs the op's body itself (``ops._nothing_sees_the_op``); under a function mode the same
    call goes through the custom op: the same bits, on the processor's defaults."""
    q, k, v = _inputs(1, 3000, 3000, 3)
    options = {"smooth_k": True, "repair_ratio": 0.005, "return_lse": return_lse}
    direct = attention(q, k, v, **options)
    with torch.device("cuda"):
        through_the_op = attention(q, k, v, **options)
    for got, want in zip(*(x if return_lse else (x,) for x in (through_the_op, direct))):
        assert torch.equal(got, want)


def test_a_gradient_through_the_kernel_raises():
    q, k, v = (x.requires_grad_() for x in _inputs(1, 1024, 1024, 2))
    out = attention(q, k, v)
    with pytest.raises(RuntimeError, match="forward-only"):
        out.float().sum().backward()


def test_a_kernel_that_fails_to_build_falls_back_with_the_reason(monkeypatch, caplog):
    import importlib
    import logging

    import openvc_diffusers
    from openvc_kernels import ops

    attention_module = importlib.import_module("openvc_diffusers.attention")  # the package exports a function

    def broken(*args, **kwargs):
        raise RuntimeError("ptxas fatal: unsupported toolkit")

    # The forward kernel neither in memory nor on disk, and its compile failing; the preparation as it is.
    monkeypatch.setattr(attention_module, "_said", set())
    loaded = {name: kernel for name, kernel in compile_cache._loaded.items() if not name.startswith("attention")}
    monkeypatch.setattr(compile_cache, "_loaded", loaded)
    cached_path = compile_cache.kernel_path

    def kernel_path(name):
        return compile_cache.Path("/nonexistent-openvc") / name if name.startswith("attention") else cached_path(name)

    monkeypatch.setattr(compile_cache, "kernel_path", kernel_path)
    monkeypatch.setattr(ops, "compile_attention", broken)
    ops.build_failure.cache_clear()
    q, k, v = _inputs(1, 2048, 2048, 2)
    try:
        with caplog.at_level(logging.WARNING, logger="openvc_diffusers"):
            out = openvc_diffusers.attention(q, k, v, {"backends": ["openvc", "sdpa"]})
            openvc_diffusers.attention(q, k, v, {"backends": ["openvc", "sdpa"]})
        with pytest.raises(ops.KernelUnavailableError, match="failed to compile: RuntimeError: ptxas fatal"):
            attention(q, k, v)
    finally:
        ops.build_failure.cache_clear()
    expected = torch.nn.functional.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)))
    torch.testing.assert_close(out, expected.transpose(1, 2))
    reasons = [r.getMessage() for r in caplog.records if "failed to compile" in r.getMessage()]
    assert len(reasons) == 1 and reasons[0].startswith("Open-VC fallback to sdpa: openvc: the FP8 kernel attention_")
