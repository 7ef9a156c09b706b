"""What any input gives, on the CPU: every shape of a grid of batch, lengths (self- and cross-attention), heads,
dtypes and options; non-finite values and huge logits; gradients; and the same error for a bad call whichever
backend the policy would pick. tests/test_sm90_gpu.py checks the kernel on the same cases."""

import itertools
import logging
import math
import re

import numpy as np
import pytest
import torch
from helpers import exact_attention
from openvc_diffusers.metrics import rel_l2

import openvc_diffusers
import openvc_kernels
from openvc_diffusers import OpenVCProcessor
from openvc_diffusers.tiny import tiny_wan_inputs, tiny_wan_transformer
from openvc_kernels.forward_only import FORWARD_ONLY
from openvc_kernels.preparation import prepare_reference
from openvc_kernels.quant import CODE_SPAN_LIMIT, limit_code_span, quantize_per_block

LENGTHS = (1, 127, 128, 129, 256, 1000)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
OPTIONS = (
    {},
    {"smooth_k": True},
    {"repair_ratio": 0.05},  # 6 repair keys at 129 tokens, 50 at 1000: at least one tile wherever S_k > 10
    {"repair_ratio": 0.05, "smooth_k": True, "repair_ranking": "attention"},
)
# rel-L2 against float64 on N(0, 1) inputs: 5.7% at S = 4096 (tests/test_reference.py); over a few rows the error
# varies more, and one row alone most (its tail over seeds: notes/kernel.md, 2026-12-04, "A flaky bound").
BOUND, FEW_ROWS_BOUND, ONE_ROW_BOUND = 0.065, 0.1, 0.125


def randn(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape).to(dtype)


GRID = list(itertools.product((1, 2), LENGTHS, LENGTHS))


@pytest.mark.parametrize(("batch", "s_q", "s_k"), GRID, ids=[f"B{b}-q{q}-k{k}" for b, q, k in GRID])
def test_every_shape_of_the_grid(batch, s_q, s_k, fresh_seed):
    # Heads, dtype and options cycle over the grid, so each value meets every batch and length.
    index = GRID.index((batch, s_q, s_k))
    heads, dtype, options = (1, 3)[index % 2], DTYPES[index % 3], OPTIONS[index // 3 % 4]
    q = randn(batch, s_q, heads, 128, dtype=dtype)
    k, v = randn(batch, s_k, heads, 128, dtype=dtype), randn(batch, s_k, heads, 128, dtype=dtype)
    out = openvc_kernels.reference_attention(q, k, v, **options)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    err = rel_l2(out, exact_attention(q, k, v))
    rows = batch * s_q * heads
    bound = BOUND if rows >= 64 else FEW_ROWS_BOUND if rows > 1 else ONE_ROW_BOUND
    assert err <= bound, f"seed {fresh_seed}, H={heads}, {dtype}, {options}: rel-L2 {err:.4f}"
    if batch == 2:  # batch rows do not mix: the second alone gives its rows bit for bit
        assert torch.equal(out[1:], openvc_kernels.reference_attention(q[1:], k[1:], v[1:], **options))


@pytest.mark.parametrize("tensor", ["q", "k", "v"])
@pytest.mark.parametrize("value", [float("inf"), -float("inf"), float("nan")])
def test_a_non_finite_value_makes_its_head_nan_and_leaves_the_others(tensor, value, fresh_seed):
    inputs = {name: randn(2, 300, 3, 128) for name in "qkv"}
    clean = openvc_kernels.reference_attention(**inputs, repair_ratio=0.01, smooth_k=True)
    batch, token, head = 1, int(torch.randint(300, ())), 2
    inputs[tensor][batch, token, head, int(torch.randint(128, ()))] = value
    out = openvc_kernels.reference_attention(**inputs, repair_ratio=0.01, smooth_k=True)
    assert out[batch, :, head].isnan().all(), f"seed {fresh_seed}"
    hit = torch.zeros(2, 3, dtype=torch.bool)
    hit[batch, head] = True
    assert torch.equal(out.transpose(1, 2)[~hit], clean.transpose(1, 2)[~hit]), f"seed {fresh_seed}"


@pytest.mark.parametrize(
    ("dtype", "factor"), [(torch.bfloat16, 5e7), (torch.bfloat16, 1e30), (torch.float16, 6e4), (torch.float32, 1e4)]
)
def test_huge_finite_logits_give_a_weighted_average_of_values(dtype, factor, fresh_seed):
    # q * 5e7: logits of ~1e8 nats, 1e9 codes, where FP32 cannot hold the anchor to a code (it gave NaN). The
    # code span limit lowers the codes' scale there; the output stays a convex combination of V rows.
    q, k, v = randn(1, 500, 2, 128), randn(1, 500, 2, 128), randn(1, 500, 2, 128)
    q = (q.float() * factor).clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype)
    out = openvc_kernels.reference_attention(q, k.to(dtype), v.to(dtype)).float()
    assert torch.isfinite(out).all(), f"seed {fresh_seed}"
    low, high = v.float().amin(dim=1, keepdim=True), v.float().amax(dim=1, keepdim=True)
    slack = 0.07 * v.float().abs().amax(dim=1, keepdim=True)  # E4M3 rounds V by up to 1/16 of its value
    assert ((out >= low - slack) & (out <= high + slack)).all(), f"seed {fresh_seed}"


def test_the_code_span_limit_leaves_ordinary_inputs_alone(fresh_seed):
    # Absmaxes near 225 for Q and K: logits of thousands of nats, still left alone.
    _, d_q = quantize_per_block(torch.randn(2, 3, 1000, 128) * 50)
    _, d_k = quantize_per_block(torch.randn(2, 3, 1000, 128) * 50)
    assert torch.equal(limit_code_span(d_q, d_k, 128**-0.5, 128), d_q)
    lowered = limit_code_span(d_q * 1e6, d_k, 128**-0.5, 128)
    bound = 128**-0.5 * openvc_kernels.expcast.CODES_PER_NAT * 128 * 448**2 * lowered * d_k.amax(-1, keepdim=True)
    assert (bound <= CODE_SPAN_LIMIT * 1.0001).all() and (lowered < d_q * 1e6).all()


def test_a_gradient_through_the_reference_raises_instead_of_being_zero():
    q, k, v = (randn(1, 256, 2, 128).requires_grad_() for _ in range(3))
    out = openvc_kernels.reference_attention(q, k, v)
    with pytest.raises(RuntimeError, match=re.escape(FORWARD_ONLY)):
        out.float().sum().backward()
    with torch.no_grad():
        assert not openvc_kernels.reference_attention(q, k, v).requires_grad


def test_calls_that_need_gradients_take_the_bf16_fallback_with_its_gradient(caplog):
    q, k, v = (torch.randn(2, 256, 2, 128, requires_grad=True) for _ in range(3))
    with caplog.at_level(logging.WARNING, logger="openvc_diffusers"):
        out = openvc_diffusers.attention(q, k, v, {"min_tokens": 0})
        openvc_diffusers.attention(q, k, v, {"min_tokens": 0})
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    expected = torch.nn.functional.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)))
    assert torch.equal(out, expected.transpose(1, 2))
    for got, want in zip(grads, torch.autograd.grad(expected.square().sum(), (q, k, v))):
        torch.testing.assert_close(got, want)
    messages = [r.getMessage() for r in caplog.records if "autograd" in r.getMessage()]
    assert messages == ["Open-VC fallback to sdpa: autograd needs gradients through this call; Open-VC is forward-only"]
    with torch.no_grad():  # without autograd the same call takes Open-VC
        assert torch.equal(
            openvc_diffusers.attention(q, k, v, {"min_tokens": 0}),
            openvc_kernels.reference_attention(q, k, v, repair_ratio=0.005, smooth_k=True),
        )


def test_fine_tuning_through_the_processor_gets_the_stock_gradients(one_thread):
    # LoRA-style training with the processor installed (its defaults: repair and smoothing): every self-attention
    # call needs gradients, so all of them take the BF16 fallback and the gradients are the stock model's.
    model, inputs = tiny_wan_transformer(), tiny_wan_inputs()
    stock = torch.autograd.grad(model(**inputs)[0].square().mean(), list(model.parameters()))
    processor = OpenVCProcessor({"min_tokens": 0})
    model.set_attn_processor(processor)
    ours = torch.autograd.grad(model(**inputs)[0].square().mean(), list(model.parameters()))
    assert processor.calls == {("self", "sdpa"): 2, ("cross", "sdpa"): 2}
    assert all(torch.equal(a, b) for a, b in zip(ours, stock))


def _good(s_q=256, s_k=256):
    return randn(1, s_q, 2, 128), randn(1, s_k, 2, 128), randn(1, s_k, 2, 128)


BAD_CALLS = {
    "integer dtype": lambda: tuple(x.to(torch.int32) for x in _good()),
    "fp8 dtype": lambda: tuple(x.to(torch.float8_e4m3fn) for x in _good()),
    "3-D q": lambda: (_good()[0][0], *_good()[1:]),
    "batch": lambda: (randn(2, 256, 2, 128), *_good()[1:]),
    "heads": lambda: (randn(1, 256, 3, 128), *_good()[1:]),
    "head_dim": lambda: (randn(1, 256, 2, 64), *_good()[1:]),
    "k 77 and v 78 tokens": lambda: (_good()[0], randn(1, 77, 2, 128), randn(1, 78, 2, 128)),
    "dtypes differ": lambda: (_good()[0].float(), *_good()[1:]),
    "not a tensor": lambda: (_good()[0].float().numpy(), *_good()[1:]),
}
CONFIGS = (
    {"min_tokens": 0},  # Open-VC (the reference on this machine)
    {"min_tokens": 10**6},  # the fallback chain
    {"backends": ["fa4", "sdpa"]},
    {"backends": ["sdpa"]},
)


@pytest.mark.parametrize("name", BAD_CALLS)
def test_a_bad_call_fails_alike_whichever_backend_would_take_it(name):
    messages = set()
    for config in CONFIGS:
        with pytest.raises(ValueError) as raised:
            openvc_diffusers.attention(*BAD_CALLS[name](), config)
        messages.add(str(raised.value))
    assert len(messages) == 1, messages


def test_float64_takes_the_fallback(caplog):
    q, k, v = (torch.randn(1, 1024, 2, 128, dtype=torch.float64) for _ in range(3))
    with caplog.at_level(logging.WARNING, logger="openvc_diffusers"):
        out = openvc_diffusers.attention(q, k, v)
    expected = torch.nn.functional.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)))
    assert torch.equal(out, expected.transpose(1, 2))
    reason = "openvc: dtype torch.float64; Open-VC takes float16, bfloat16, float32"
    assert any(reason in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("scale", [-0.0884, 0.0, -0.0, math.nan, math.inf, True, "0.1"])
def test_a_softmax_scale_that_is_not_positive_and_finite_is_refused(scale):
    """A negative scale would make the running max a minimum: the reference's output came out at rel-L2 9.7 from
    exact attention on N(0, 1) inputs before this check. Every entry point names the value and what it accepts."""
    q = torch.randn(1, 64, 2, 128, dtype=torch.bfloat16)
    accepted = r"softmax_scale must be a finite number > 0 \(or None: 1 / sqrt\(head_dim\)\)"
    message = f"{accepted}, got {re.escape(repr(scale))}"
    with pytest.raises(ValueError, match=message):
        openvc_kernels.reference_attention(q, q, q, softmax_scale=scale)
    with pytest.raises(ValueError, match=message):  # before the kernel's device check: this is the CPU
        openvc_kernels.attention(q, q, q, softmax_scale=scale)
    with pytest.raises(ValueError, match=message):
        openvc_kernels.prepare(q, q, q, softmax_scale=scale)
    with pytest.raises(ValueError, match=message):
        openvc_kernels.attention_prepared(None, q, softmax_scale=scale)


def test_positive_scales_of_any_real_type_are_taken(fresh_seed):
    q, k, v = (torch.randn(1, 64, 2, 128) for _ in range(3))
    expected = openvc_kernels.reference_attention(q, k, v, softmax_scale=0.25)
    for scale in (np.float32(0.25), np.float64(0.25), 0.25):
        assert torch.equal(openvc_kernels.reference_attention(q, k, v, softmax_scale=scale), expected)


@pytest.mark.parametrize("flag", ["no", 1, None])
def test_return_lse_must_be_a_bool(flag):
    """A truthy string would silently return a tuple."""
    q = torch.randn(1, 64, 2, 128, dtype=torch.bfloat16)
    message = rf"return_lse must be True or False, got {re.escape(repr(flag))}"
    for entry in (openvc_kernels.reference_attention, openvc_kernels.attention):
        with pytest.raises(ValueError, match=message):
            entry(q, q, q, return_lse=flag)


def test_attention_prepared_checks_its_options_and_out():
    """The kernel stops writing at ``out``'s length and visits the prepared query tiles: an ``out`` of another
    length, layout, dtype or shape would come back with rows never written. Checked before anything runs (here on
    the CPU: the kernel itself is never reached)."""
    from openvc_kernels.ops import check_prepared_out

    q = torch.randn(2, 300, 3, 128, dtype=torch.bfloat16)
    prepared = prepare_reference(q, q, q)
    ok = torch.empty(2, 300, 3, 128, dtype=torch.bfloat16)
    accepted = re.escape(
        "accepted: a contiguous torch.bfloat16 tensor (batch, seq_q, heads, 128) = (2, S_q, 3, 128) on cpu, S_q from "
        "257 to 384 (in the last prepared query tile"
    )
    bad_outs = {
        "longer": torch.empty(2, 385, 3, 128, dtype=torch.bfloat16),
        "shorter": torch.empty(2, 256, 3, 128, dtype=torch.bfloat16),
        "heads": torch.empty(2, 300, 4, 128, dtype=torch.bfloat16),
        "dtype": ok.half(),
        "strided": torch.empty(2, 3, 300, 128, dtype=torch.bfloat16).transpose(1, 2),
    }
    for length in (257, 300, 384):
        check_prepared_out(prepared, torch.empty(2, length, 3, 128, dtype=torch.bfloat16))
    for name, out in bad_outs.items():
        with pytest.raises(ValueError, match=rf"out is a .* tensor of shape .*; {accepted}"):
            openvc_kernels.attention_prepared(prepared, out, softmax_scale=0.1)
    with pytest.raises(ValueError, match=r"out must be a torch.Tensor, got NoneType"):
        openvc_kernels.attention_prepared(prepared, None, softmax_scale=0.1)
    for options, message in (
        ({"window": -1}, "window must be an int >= 0 or None (plain order), got -1"),
        ({"window": 2.0}, "window must be an int >= 0 or None (plain order), got 2.0"),
        ({"split_tail": "yes"}, "split_tail must be True or False, got 'yes'"),
        ({"return_lse": 1}, "return_lse must be True or False, got 1"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            openvc_kernels.attention_prepared(prepared, ok, softmax_scale=0.1, **options)


def test_a_window_past_the_key_tiles_is_clamped_to_the_same_order():
    """Any window from the key tile count on visits in one order (the reference's ``visiting_order``); the kernel
    takes it as an Int32, so ``forward_args`` clamps it (2**31 would wrap to a negative start tile)."""
    from openvc_kernels.ops import forward_args
    from openvc_kernels.reference import visiting_order

    n_k = 3
    for n_q in (1, 3, 7):
        assert torch.equal(visiting_order(n_q, n_k, n_k), visiting_order(n_q, n_k, 2**40))
        assert not torch.equal(visiting_order(n_q, n_k, n_k - 2), visiting_order(n_q, n_k, n_k))
    q = torch.randn(1, 300, 2, 128, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    for window, taken in ((None, 0), (0, 0), (2, 2), (n_k, n_k), (2**31, n_k), (2**40, n_k)):
        args = forward_args(prepare_reference(q, q, q), out, softmax_scale=0.1, window=window, split_tail=False)
        assert args.window == taken, window


@pytest.mark.parametrize("flag", ["no", 1, None])
def test_smooth_k_must_be_a_bool(flag):
    """A truthy string or number would silently turn K smoothing on."""
    q = torch.randn(1, 64, 2, 128, dtype=torch.bfloat16)
    for entry in (openvc_kernels.reference_attention, openvc_kernels.attention, openvc_kernels.prepare):
        with pytest.raises(ValueError, match=rf"smooth_k must be True or False, got {re.escape(repr(flag))}"):
            entry(q, q, q, smooth_k=flag)
