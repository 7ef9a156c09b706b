"""``validation.check_qkv``'s message for each bad call, word for word, and the calls it takes: the policy runs it on
every call, so every backend fails alike with these words. Meta tensors: the check reads shapes, dtypes and devices
only."""

import numpy as np
import pytest
import torch

from openvc_kernels.validation import check_qkv


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def good(s_q=16, s_k=16, dtype=torch.bfloat16):
    return meta(1, s_q, 2, 128, dtype=dtype), meta(1, s_k, 2, 128, dtype=dtype), meta(1, s_k, 2, 128, dtype=dtype)


def replaced(**tensors):
    """``good()``'s q, k, v with some of them replaced."""
    return {**dict(zip("qkv", good())), **tensors}


ACCEPTED = "attention takes float16, bfloat16, float32 or float64"
LAYOUT = "(layout (batch, seq_len, heads, head_dim))"
BAD_CALLS = [
    (replaced(q=np.zeros((1, 16, 2, 128))), "q must be a torch.Tensor, got ndarray"),
    (replaced(k=None), "k must be a torch.Tensor, got NoneType"),
    (replaced(v=[[0.0]]), "v must be a torch.Tensor, got list"),
    (replaced(q=meta(16, 2, 128)), "q must be 4-D (batch, seq_len, heads, head_dim), got shape (16, 2, 128)"),
    (
        replaced(k=meta(1, 1, 16, 2, 128)),
        "k must be 4-D (batch, seq_len, heads, head_dim), got shape (1, 1, 16, 2, 128)",
    ),
    (replaced(v=meta(())), "v must be 4-D (batch, seq_len, heads, head_dim), got shape ()"),
    (replaced(q=meta(1, 16, 2, 128, dtype=torch.int32)), f"q has dtype torch.int32; {ACCEPTED}"),
    (replaced(k=meta(1, 16, 2, 128, dtype=torch.bool)), f"k has dtype torch.bool; {ACCEPTED}"),
    (replaced(v=meta(1, 16, 2, 128, dtype=torch.uint8)), f"v has dtype torch.uint8; {ACCEPTED}"),
    (replaced(q=meta(1, 16, 2, 128, dtype=torch.float8_e4m3fn)), f"q has dtype torch.float8_e4m3fn; {ACCEPTED}"),
    (replaced(k=meta(1, 16, 2, 128, dtype=torch.float8_e5m2)), f"k has dtype torch.float8_e5m2; {ACCEPTED}"),
    (replaced(v=meta(1, 16, 2, 128, dtype=torch.float8_e8m0fnu)), f"v has dtype torch.float8_e8m0fnu; {ACCEPTED}"),
    (replaced(q=meta(1, 16, 2, 128, dtype=torch.complex64)), f"q has dtype torch.complex64; {ACCEPTED}"),
    (replaced(k=meta(1, 16, 2, 128, dtype=torch.complex128)), f"k has dtype torch.complex128; {ACCEPTED}"),
    (
        replaced(k=torch.empty(1, 16, 2, 128, dtype=torch.bfloat16)),
        "k is on cpu but q is on meta; all inputs must share a device",
    ),
    (
        dict(zip("qkv", (torch.empty(1, 16, 2, 128, dtype=torch.bfloat16), *good()[1:]))),
        "k is on meta but q is on cpu; all inputs must share a device",
    ),
    (
        replaced(v=meta(1, 16, 2, 128, dtype=torch.float32)),
        "v has dtype torch.float32 but q has torch.bfloat16; all inputs must share a dtype",
    ),
    (
        dict(zip("qkv", (meta(1, 16, 2, 128, dtype=torch.float64), *good()[1:]))),
        "k has dtype torch.bfloat16 but q has torch.float64; all inputs must share a dtype",
    ),
    (replaced(q=meta(1, 0, 2, 128)), "q has an empty dimension: shape (1, 0, 2, 128)"),
    (replaced(k=meta(0, 16, 2, 128), v=meta(0, 16, 2, 128)), "k has an empty dimension: shape (0, 16, 2, 128)"),
    (replaced(v=meta(1, 16, 2, 0)), "v has an empty dimension: shape (1, 16, 2, 0)"),
    (
        replaced(k=meta(1, 77, 2, 128), v=meta(1, 78, 2, 128)),
        "k and v must have the same shape, got (1, 77, 2, 128) and (1, 78, 2, 128)",
    ),
    (replaced(v=meta(1, 16, 2, 64)), "k and v must have the same shape, got (1, 16, 2, 128) and (1, 16, 2, 64)"),
    (
        replaced(q=meta(2, 16, 2, 128)),
        f"q (2, 16, 2, 128) and k (1, 16, 2, 128) must agree in batch, heads and head_dim {LAYOUT}",
    ),
    (
        replaced(q=meta(1, 16, 3, 128)),
        f"q (1, 16, 3, 128) and k (1, 16, 2, 128) must agree in batch, heads and head_dim {LAYOUT}",
    ),
    (
        replaced(k=meta(1, 16, 2, 64), v=meta(1, 16, 2, 64)),
        f"q (1, 16, 2, 128) and k (1, 16, 2, 64) must agree in batch, heads and head_dim {LAYOUT}",
    ),
    # The first failing check of the first failing tensor, in the order q, k, v.
    (
        replaced(q=meta(16, 2, 128), k=None),
        "q must be 4-D (batch, seq_len, heads, head_dim), got shape (16, 2, 128)",
    ),
    (replaced(k=torch.empty(1, 16, 2, 128, dtype=torch.int32)), f"k has dtype torch.int32; {ACCEPTED}"),
    (
        replaced(k=torch.empty(1, 16, 2, 128, dtype=torch.float32)),
        "k is on cpu but q is on meta; all inputs must share a device",
    ),
    (
        replaced(k=meta(1, 16, 2, 128, dtype=torch.float32), v=meta(1, 0, 2, 128)),
        "k has dtype torch.float32 but q has torch.bfloat16; all inputs must share a dtype",
    ),
    (
        replaced(q=meta(2, 0, 2, 128), v=meta(1, 78, 2, 128)),
        "q has an empty dimension: shape (2, 0, 2, 128)",
    ),
    (
        replaced(q=meta(2, 16, 2, 128), v=meta(1, 78, 2, 128)),
        "k and v must have the same shape, got (1, 16, 2, 128) and (1, 78, 2, 128)",
    ),
]


@pytest.mark.parametrize(("qkv", "message"), BAD_CALLS, ids=[message for _, message in BAD_CALLS])
def test_each_bad_call_gets_its_message(qkv, message):
    with pytest.raises(ValueError) as raised:
        check_qkv(qkv["q"], qkv["k"], qkv["v"])
    assert str(raised.value) == message


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_floating_point_inputs_of_any_length_are_taken(dtype, device):
    shapes = ((2, 7, 3, 64), (2, 1, 3, 64), (2, 1, 3, 64))  # S_q may differ from S_k
    q, k, v = (torch.empty(shape, dtype=dtype, device=device) for shape in shapes)
    check_qkv(q, k, v)
