"""The descale guards of ``quant`` on the CPU: the code span limit's FP32 formula, spelled out (an IEEE reciprocal, then
one product with an FP32 constant), is the former ``(CODE_SPAN_LIMIT / per_descale) / d_k_max`` bit for bit, and
what the guards do with inf and NaN. tests/test_sm90_prep.py checks the fused guard kernel against these on the GPU.
And K smoothing's channel mean: every 8th key counted once and no other key, whatever the length and layout, in the
order it names."""

import struct

import pytest
import torch

from openvc_kernels.expcast import CODES_PER_NAT
from openvc_kernels.quant import (
    BLOCK_SUM_ORDER,
    CODE_SPAN_LIMIT,
    FP8_MAX,
    MEAN_SEGMENTS,
    MEAN_TOKEN_STRIDE,
    apply_descale_guards,
    channel_mean,
    code_span_numerator,
    code_span_quotient,
    limit_code_span,
    mean_keys,
    mean_tokens,
    poison_non_finite,
)

SCALES = (128**-0.5, 0.09, 1.0, 0.0173)


def _former_limit(d_q, d_k, softmax_scale, head_dim):
    """``limit_code_span`` as it was written before the formula was spelled out."""
    per_descale = softmax_scale * CODES_PER_NAT * head_dim * FP8_MAX * FP8_MAX
    return torch.minimum(d_q, (CODE_SPAN_LIMIT / per_descale) / d_k.amax(dim=-1, keepdim=True))


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32)


@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("softmax_scale", SCALES)
def test_the_spelled_out_limit_is_the_former_formula_bit_for_bit(fresh_seed, softmax_scale, head_dim):
    # Descales over 17 decades: the limit bites on a part of the blocks and leaves the others alone.
    d_q = torch.empty(3, 5, 257).uniform_(-30, 10).exp()
    d_k = torch.empty(3, 5, 929).uniform_(-30, 10).exp()
    got = limit_code_span(d_q, d_k, softmax_scale, head_dim)
    assert torch.equal(_bits(got), _bits(_former_limit(d_q, d_k, softmax_scale, head_dim))), f"seed {fresh_seed}"
    lowered = got < d_q
    assert lowered.any() and not lowered.all(), f"seed {fresh_seed}"
    assert torch.equal(got[~lowered], d_q[~lowered])


@pytest.mark.parametrize("softmax_scale", SCALES)
def test_the_numerator_is_the_double_quotient_rounded_once_to_fp32(softmax_scale):
    exact = CODE_SPAN_LIMIT / (softmax_scale * CODES_PER_NAT * 128 * FP8_MAX * FP8_MAX)
    assert code_span_quotient(softmax_scale, 128) == exact
    numerator = code_span_numerator(softmax_scale, 128)
    assert numerator == torch.tensor(exact, dtype=torch.float32).item()  # torch's own double -> float rounding
    assert struct.unpack("f", struct.pack("f", numerator))[0] == numerator  # an FP32 value, converted exactly
    assert abs(numerator - exact) <= abs(exact) * 2.0**-24


@pytest.mark.parametrize("softmax_scale", SCALES)
def test_the_bound_is_a_reciprocal_then_a_product(fresh_seed, softmax_scale):
    """With d_q = inf the result is the bound itself: ``reciprocal(d_k_max) * code_span_numerator`` (the FP32
    constant the kernel gets; torch rounds the double quotient to it before multiplying), what ``number / tensor``
    computes in torch; one IEEE division of the same numbers differs in the last bit on some heads, so the choice
    is visible (the kernel must make the same one)."""
    d_k = torch.empty(4000, 1, 7).uniform_(-30, 10).exp()
    d_k_max = d_k.amax(dim=-1, keepdim=True)
    numerator = code_span_numerator(softmax_scale, 128)
    bound = limit_code_span(torch.full((4000, 1, 3), float("inf")), d_k, softmax_scale, 128)
    two_roundings = (d_k_max.reciprocal() * numerator).expand_as(bound)
    assert torch.equal(_bits(bound), _bits(two_roundings))
    assert torch.equal(_bits(bound), _bits((numerator / d_k_max).expand_as(bound)))
    one_division = torch.full_like(d_k_max, numerator) / d_k_max
    assert (d_k_max.reciprocal() * numerator != one_division).any(), f"seed {fresh_seed}"


def test_non_finite_descales():
    d_q, d_k, d_v = torch.full((2, 4, 3), 0.01), torch.full((2, 4, 5), 0.02), torch.full((2, 4), 0.03)
    d_q[0, 0, 1] = float("nan")
    d_k[0, 1, 4] = float("nan")
    d_k[0, 2, 0] = float("inf")
    d_v[1, 0] = float("inf")
    d_q[1, 1, 2] = float("inf")
    d_q[1, 2] = 1e9  # finite, lowered
    new_q, new_v = apply_descale_guards(d_q, d_k, d_v, 128**-0.5, head_dim=128)
    assert new_q[0, 0, 1].isnan() and torch.equal(new_q[0, 0, [0, 2]], d_q[0, 0, [0, 2]])
    assert new_q[0, 1].isnan().all()  # NaN in d_k: the bound is NaN, torch.minimum keeps it
    assert torch.equal(new_q[0, 2], torch.zeros(3))  # inf in d_k: the bound is 0
    bound = torch.tensor(0.02).reciprocal() * code_span_numerator(128**-0.5, 128)  # 32: d_q above it is lowered
    assert new_q[1, 1, 2] == bound and torch.equal(new_q[1, 1, :2], d_q[1, 1, :2])
    assert (new_q[1, 2] == bound).all() and torch.equal(new_q[1, 3], d_q[1, 3])
    poisoned = torch.tensor([[True, True, True, False], [True, True, False, False]])
    assert torch.equal(new_v.isnan(), poisoned)
    assert (_bits(new_v[poisoned]) == 0x7FC00000).all()  # masked_fill's float32(nan), the kernel's poison
    assert torch.equal(_bits(new_v[~poisoned]), _bits(d_v[~poisoned]))
    assert torch.equal(_bits(poison_non_finite(d_q, d_k, d_v)), _bits(new_v))


@pytest.mark.parametrize("seq", [1, 7, 8, 9, 129, 1027, 4000])
def test_the_mean_reads_every_eighth_key(seq):
    """``mean_tokens`` counts the keys ``channel_mean`` reads and ``mean_keys`` takes them, also from a shard's
    first token on."""
    tokens = torch.arange(0, seq, MEAN_TOKEN_STRIDE)
    k = torch.arange(seq).view(1, seq, 1, 1)
    assert mean_tokens(seq) == len(tokens)
    assert torch.equal(mean_keys(k).flatten(), tokens)
    # A ring's shards, each from its first token on, take the whole sequence's keys between them.
    for cut in (seq // 3, seq // 3 + 1):
        shards = torch.cat([mean_keys(k[:, :cut]), mean_keys(k[:, cut:], cut)], dim=1)
        assert torch.equal(shards.flatten(), tokens)


@pytest.mark.parametrize("seq", [1, 2, 129, 1027, 2100])
@pytest.mark.parametrize("layout", ["contiguous", "k of fused qkv", "head-major"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_channel_mean_counts_every_eighth_key_once(fresh_seed, seq, layout, dtype):
    """Small integers sum exactly in FP32, so whatever the layout the mean is the exact sum of every 8th key divided
    once by their count; the outliers in the first and last tokens would show one dropped or counted twice (or, where
    the last token is not read, counted), and those in tokens 1, 9, 17, ... one counted that is not read."""
    batch, heads, dim = 2, 3, 16
    qkv = torch.randint(-8, 9, (batch, seq, 3, heads, dim)).to(dtype)
    qkv[:, 0, :, :, 0] = 1000.0
    qkv[:, -1, :, :, 1] = -3000.0
    qkv[:, 1::MEAN_TOKEN_STRIDE, :, :, 2] = 500.0
    k = {
        "contiguous": qkv[:, :, 1].contiguous(),
        "k of fused qkv": qkv[:, :, 1],  # token stride 3 H D
        "head-major": qkv[:, :, 1].transpose(1, 2).contiguous().transpose(1, 2),
    }[layout]
    mean = channel_mean(k)
    tokens = torch.arange(0, seq, MEAN_TOKEN_STRIDE)
    assert mean.shape == (batch, heads, dim) and mean.dtype == torch.float32
    assert torch.equal(mean, k[:, tokens].double().sum(dim=1).float() / len(tokens)), f"seed {fresh_seed}"


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def _spelled_out_mean(column: list[float]) -> float:
    """``channel_mean`` of one (batch, head, channel) column, each FP32 addition written out in the order
    ``BLOCK_SUM_ORDER`` and ``MEAN_SEGMENTS`` describe, the keys other than every ``MEAN_TOKEN_STRIDE``-th as +0."""
    passes, warps, rows = BLOCK_SUM_ORDER
    block_len = passes * warps * rows
    token = lambda p, w, r: (p * warps + w) * rows + r  # token = 32 pass + 4 warp + row
    add = lambda a, b: _f32(a + b)
    n = -(-len(column) // block_len)
    read = [x if t % MEAN_TOKEN_STRIDE == 0 else 0.0 for t, x in enumerate(column)]
    padded = read + [0.0] * (n * block_len - len(column))
    block_sums = []
    for block in range(n):
        x = padded[block * block_len:(block + 1) * block_len]
        row_sums = [[0.0] * rows for _ in range(warps)]
        for w in range(warps):
            for r in range(rows):
                total = x[token(0, w, r)]
                for p in range(1, passes):
                    total = add(total, x[token(p, w, r)])
                row_sums[w][r] = total
        warp_sums = [add(add(s[0], s[1]), add(s[2], s[3])) for s in row_sums]
        total = warp_sums[0]
        for w in range(1, warps):
            total = add(total, warp_sums[w])
        block_sums.append(total)
    total = None
    for j in range(MEAN_SEGMENTS):
        part = 0.0
        for i in range(j * n // MEAN_SEGMENTS, (j + 1) * n // MEAN_SEGMENTS):
            part = add(part, block_sums[i])
        total = part if total is None else add(total, part)
    return _f32(total / len(range(0, len(column), MEAN_TOKEN_STRIDE)))


@pytest.mark.parametrize("seq", [1, 37, 128, 300, 1100, 2100])
def test_the_channel_mean_adds_in_the_order_it_names(fresh_seed, seq):
    """The vectorized ``channel_mean`` against each of its additions written out: the same bits. FP32 values with
    channel offsets as video DiTs' K carry make the order show (a sequential sum differs in the last bits)."""
    k = torch.randn(1, seq, 2, 4) + torch.tensor([0.0, 3.0, -40.0, 900.0])
    mean = channel_mean(k)
    expected = torch.tensor(
        [[[_spelled_out_mean(k[0, :, h, c].float().tolist()) for c in range(4)] for h in range(2)]]
    )
    assert torch.equal(mean, expected), f"seed {fresh_seed}"
