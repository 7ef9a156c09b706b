"""The sm90 kernel's log-sum-exp (``ForwardConfig.write_lse``, ``attention(return_lse=True)``), its shared scales
(``v_absmax``, ``k_mean``) and key shards merged with ``merge_attention``, on a Hopper GPU (skipped elsewhere)."""

import math

import pytest
import torch

from openvc_kernels import merge_attention
from openvc_kernels.expcast import LN2, LOG2_PER_CODE
from openvc_kernels.ops import _kernel, attention, forward_args, prepare, sm_count
from openvc_kernels.preparation import PrepareOptions, prepare_reference
from openvc_kernels.quant import mean_keys, smoothing_lse_shift, smoothing_mean
from openvc_kernels.reference import reference_attention
from openvc_kernels.sm90.config import ForwardConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
        reason="needs a Hopper GPU",
    ),
]

TAU = 128**-0.5
LSE_ATOL = 1e-4
"""nats, kernel against the wgmma-summing reference: FP32 order of l's sums, MUFU ex2 in the rescale and the merge,
and MUFU lg2.approx (2^-22 relative) against torch's log2 leave differences near 1e-6; the bound leaves room."""
LSE_AGREE_SHARE = 0.999
"""Rows within LSE_ATOL: a rounding tie can flip one code, or a row's anchor by one code, which moves its lse by
ExpCast's own error (at most ONE_CODE) rather than by rounding."""
ONE_CODE = LN2 * LOG2_PER_CODE
REL_L2 = 1e-3
"""The output against the wgmma-summing reference, as tests/test_sm90_gpu.py."""
SHARD_REL_L2 = 0.05
"""Merged kernel shards against the unsplit kernel call on N(0, 1) inputs: each shard's rows sit on their own
anchors, so every code rounds anew (the reference measures 1.7% .. 3.5% on CPU shapes, tests/test_lse.py)."""
SHARD_LSE = 0.02
SAME_ANCHOR_REL_L2 = 4e-3
"""Shards that keep the unsplit call's anchors (tests/test_lse.py's max-key inputs): BF16 rounding of the parts."""


def _rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _inputs(batch, s_q, s_k, heads, dtype=torch.bfloat16):
    # Fresh random inputs on every call: no seed.
    q = torch.randn(batch, s_q, heads, 128, device="cuda", dtype=dtype)
    k = torch.randn(batch, s_k, heads, 128, device="cuda", dtype=dtype)
    v = torch.randn(batch, s_k, heads, 128, device="cuda", dtype=dtype)
    return q, k, v


def _assert_lse_matches(lse: torch.Tensor, ref: torch.Tensor) -> None:
    assert lse.shape == ref.shape and lse.dtype == torch.float32
    diff = (lse - ref.to(lse.device)).abs()
    share = (diff <= LSE_ATOL + 1e-5 * ref.abs().to(lse.device)).float().mean().item()
    assert share >= LSE_AGREE_SHARE, f"{1 - share:.3%} of the rows differ by more than {LSE_ATOL}"
    assert diff.max().item() <= ONE_CODE, f"lse differs by {diff.max().item():.3g} nats"


def _run_poisoned(q, k, v, *, window=4, split_tail=True, smooth_k=False, repair_ratio=0.0, **scales):
    """The lse kernel on the PyTorch preparation, into NaN-filled out and lse (every element must be written);
    with ``smooth_k`` the lse's q . mean shift added as ``attention`` adds it."""
    batch, s_q, heads, _ = q.shape
    out = torch.full(q.shape, math.nan, dtype=torch.bfloat16, device="cuda")
    lse = torch.full((batch, heads, s_q), math.nan, dtype=torch.float32, device="cuda")
    prepared = prepare_reference(q, k, v, PrepareOptions(smooth_k=smooth_k, repair_ratio=repair_ratio), **scales)
    args = forward_args(prepared, out, softmax_scale=TAU, window=window, split_tail=split_tail, lse=lse)
    _kernel(ForwardConfig(plain_order=window is None, write_lse=True))(*args)
    torch.cuda.synchronize()
    assert not out.isnan().any(), "output elements left unwritten"
    assert not lse.isnan().any(), "lse elements left unwritten"
    lse = lse.transpose(1, 2)
    if smooth_k:
        lse = lse + smoothing_lse_shift(q, smoothing_mean(k, scales.get("k_mean")), TAU)
    return out, lse


def _reference(q, k, v, **options):
    options.setdefault("sm_count", sm_count(q.device))
    return reference_attention(q, k, v, accumulation="wgmma", return_lse=True, **options)


@pytest.mark.parametrize(
    "batch,seq,heads,options",
    [
        (1, 1, 1, {}),
        (1, 127, 1, {}),
        (2, 1000, 3, {}),
        (1, 4096, 12, {}),
        (2, 4096, 1, {}),  # every unit in 2 pieces on an H200: lse after the merge
        (1, 6144, 3, {}),  # the last 12 units in 3 pieces
        (2, 4096, 1, {"window": None}),
        (1, 2000, 2, {"smooth_k": True}),
        (2, 4096, 1, {"smooth_k": True}),
        (1, 3000, 2, {"repair_ratio": 0.01}),
        (1, 3000, 2, {"repair_ratio": 0.01, "smooth_k": True}),
        (1, 32760, 2, {}),
    ],
)
def test_lse_matches_reference(batch, seq, heads, options):
    q, k, v = _inputs(batch, seq, seq, heads)
    if options.get("smooth_k"):
        k[..., :4] += 20.0
    out, lse = _run_poisoned(q, k, v, **options)
    ref, ref_lse = _reference(q, k, v, **options)
    assert _rel_l2(out, ref) <= REL_L2
    _assert_lse_matches(lse, ref_lse)


def test_lse_without_the_tail_split_matches_the_unsplit_reference():
    q, k, v = _inputs(2, 4096, 4096, 1)
    _, lse = _run_poisoned(q, k, v, split_tail=False)
    _assert_lse_matches(lse, _reference(q, k, v, sm_count=None)[1])


def test_complete_call_with_lse_matches_reference():
    """The fused preparation (its own mean for smooth_k, reduced once for the keys and the lse) and the kernel."""
    q, k, v = _inputs(2, 4100, 4100, 3)
    k[..., :4] += 20.0
    for options in ({}, {"smooth_k": True}, {"smooth_k": True, "repair_ratio": 0.01}):
        out, lse = attention(q, k, v, return_lse=True, **options)
        assert lse.shape == (2, 4100, 3) and lse.stride() == (3 * 4100, 1, 4100)
        ref, ref_lse = _reference(q, k, v, **options)
        assert _rel_l2(out, ref) <= REL_L2
        _assert_lse_matches(lse, ref_lse)


def test_the_output_is_bitwise_the_same_with_and_without_lse():
    q, k, v = _inputs(2, 4096, 4096, 3)
    for options in ({}, {"smooth_k": True, "repair_ratio": 0.01}, {"window": None}):
        out, _ = attention(q, k, v, return_lse=True, **options)
        assert torch.equal(out, attention(q, k, v, **options))


def _shared_scales(k, v):
    """A ring's all-reduced scales: V's per-head absmax, and K's mean over the keys the unsplit call's reads."""
    return v.float().abs().amax(dim=(1, 3)), mean_keys(k).float().mean(dim=1)


def test_shared_scales_prepare_the_reference_bytes():
    """With v_absmax the fused preparation skips its absmax launch; with k_mean it subtracts that mean."""
    q, k, v = _inputs(2, 1000, 1500, 3)
    v_absmax, k_mean = _shared_scales(k, v)
    v_absmax = v_absmax * 1.5  # a larger (all-shards) absmax than this call's
    k_mean = k_mean + 0.25
    got = prepare(q, k, v, smooth_k=True, v_absmax=v_absmax, k_mean=k_mean)
    want = prepare_reference(q, k, v, PrepareOptions(smooth_k=True), v_absmax=v_absmax, k_mean=k_mean)
    for name, a, b in zip(got._fields[:-1], got[:-1], want[:-1]):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
    out, lse = attention(q, k, v, return_lse=True, smooth_k=True, v_absmax=v_absmax, k_mean=k_mean)
    ref, ref_lse = _reference(q, k, v, smooth_k=True, v_absmax=v_absmax, k_mean=k_mean)
    assert _rel_l2(out, ref) <= REL_L2
    _assert_lse_matches(lse, ref_lse)


def _kernel_shards(q, k, v, cuts, **options):
    v_absmax, k_mean = _shared_scales(k, v)
    if not options.get("smooth_k"):
        k_mean = None
    edges = [0, *cuts, k.shape[1]]
    parts = [
        attention(q, k[:, a:b], v[:, a:b], return_lse=True, v_absmax=v_absmax, k_mean=k_mean, **options)
        for a, b in zip(edges, edges[1:])
    ]
    return merge_attention([out for out, _ in parts], [lse for _, lse in parts])


@pytest.mark.parametrize("cuts", [[4096], [2560, 5120], [4000], [3000, 5555]])
@pytest.mark.parametrize("smooth_k", [False, True])
def test_kernel_shards_merge_into_the_unsplit_call(cuts, smooth_k):
    """Two and three key shards, of whole 128-key blocks and not, each with the all-keys V absmax and K mean."""
    q, k, v = _inputs(1, 2048, 8192, 4)
    out, lse = _kernel_shards(q, k, v, cuts, smooth_k=smooth_k)
    ref, ref_lse = attention(q, k, v, return_lse=True, smooth_k=smooth_k)
    assert out.dtype == torch.bfloat16
    assert _rel_l2(out, ref) <= SHARD_REL_L2
    assert (lse - ref_lse).abs().max().item() <= SHARD_LSE


def _max_key_inputs(batch, seq, heads):
    """Exact scores whose row max is one key of every 128-key block (tests/test_lse.py): shards of whole blocks
    keep the unsplit call's anchors."""

    def ternary():
        x = torch.zeros(batch, seq, heads, 128, device="cuda")
        x[..., 1:8] = torch.randint(-1, 2, (batch, seq, heads, 7), device="cuda").float()
        return x

    q, k = ternary(), ternary()
    q[..., 0] = 1.0
    k[:, 5::128] = 0.0
    k[:, 5::128, :, 0] = 8.0
    return q.bfloat16(), k.bfloat16(), torch.randn(batch, seq, heads, 128, device="cuda", dtype=torch.bfloat16)


@pytest.mark.parametrize("cuts", [[2048], [1024, 3072]])
def test_kernel_shards_on_the_unsplit_anchors_merge_to_bf16_rounding(cuts):
    q, k, v = _max_key_inputs(1, 4096, 3)
    out, lse = _kernel_shards(q, k, v, cuts)
    ref, ref_lse = attention(q, k, v, return_lse=True)
    assert _rel_l2(out, ref) <= SAME_ANCHOR_REL_L2
    assert (lse - ref_lse).abs().max().item() <= LSE_ATOL


def test_torch_compile_traces_the_lse_op():
    q, k, v = _inputs(1, 2000, 2000, 2)
    k[..., :4] += 20.0
    v_absmax, k_mean = _shared_scales(k, v)

    def call(q, k, v, v_absmax, k_mean):
        out, lse = attention(q, k, v, return_lse=True, smooth_k=True, v_absmax=v_absmax, k_mean=k_mean)
        return out.float() * 2, lse + 1

    compiled = torch.compile(call, fullgraph=True)
    got, expected = compiled(q, k, v, v_absmax, k_mean), call(q, k, v, v_absmax, k_mean)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_cuda_graph_replay_with_lse_and_shared_scales():
    """The shared scales' value checks wait for the device: they are skipped while capturing."""
    q, k, v = _inputs(1, 4100, 4100, 2)
    v_absmax, _ = _shared_scales(k, v)
    attention(q, k, v, return_lse=True, v_absmax=v_absmax)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out, static_lse = attention(q, k, v, return_lse=True, v_absmax=v_absmax)
    q.copy_(torch.randn_like(q))
    graph.replay()
    out, lse = attention(q, k, v, return_lse=True, v_absmax=v_absmax)
    assert torch.equal(static_out, out) and torch.equal(static_lse, lse)


def test_a_non_finite_value_makes_its_heads_lse_nan():
    q, k, v = _inputs(2, 1000, 1000, 3)
    clean, clean_lse = attention(q, k, v, return_lse=True)
    v[1, 7, 2, 5] = math.inf
    _, lse = attention(q, k, v, return_lse=True)
    assert lse[1, :, 2].isnan().all()
    hit = torch.zeros(2, 3, dtype=torch.bool, device="cuda")
    hit[1, 2] = True
    assert torch.equal(lse.transpose(1, 2)[~hit], clean_lse.transpose(1, 2)[~hit])


def test_bad_shared_scales_raise():
    q, k, v = _inputs(1, 256, 256, 2)
    with pytest.raises(ValueError, match="v_absmax is on cpu"):
        attention(q, k, v, v_absmax=torch.ones(1, 2))
    with pytest.raises(ValueError, match="v_absmax holds negative values"):
        attention(q, k, v, v_absmax=-torch.ones(1, 2, device="cuda"))
    with pytest.raises(ValueError, match="smooth_k=True"):
        attention(q, k, v, k_mean=torch.zeros(1, 2, 128, device="cuda"))
