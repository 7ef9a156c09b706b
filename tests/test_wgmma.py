"""The FP8 wgmma accumulation model: 14 significant bits, terms and result cut toward zero, C in the alignment."""

import pytest
import torch
from helpers import exact_attention
from openvc_diffusers.metrics import rel_l2

from openvc_kernels import reference_attention
from openvc_kernels.wgmma import wgmma_e4m3_dot


def block(*pairs) -> tuple[torch.Tensor, torch.Tensor]:
    """One 32-wide k block (zero-padded) from (a, b) product pairs, as (1, 32) rows."""
    a, b = torch.zeros(1, 32), torch.zeros(1, 32)
    for i, (x, y) in enumerate(pairs):
        a[0, i], b[0, i] = x, y
    return a, b


def test_terms_below_13_fraction_bits_are_cut_toward_zero():
    for small in (2.0**-9, -(2.0**-9)):
        a, b = block((1.0, 1.0), (small, 2.0**-6))  # 1 +- 2^-15: the small term is 2^-2 units after alignment
        assert wgmma_e4m3_dot(a, b).item() == 1.0  # not 1 - 2^-13 (floor) for the negative term
    a, b = block((1.0, 1.0), (2.0**-9, 1.0))
    assert wgmma_e4m3_dot(a, b).item() == 1.0 + 2.0**-9  # within 13 fraction bits: kept


def test_the_accumulator_sets_the_alignment_of_the_next_block():
    a = torch.zeros(1, 64)
    b = torch.zeros(1, 64)
    a[0, 0] = b[0, 0] = 32.0  # block 0: 1024
    a[0, 32:], b[0, 32:] = 1.0, 2.0**-6  # block 1: 32 x 2^-6 = 0.5, each term 16 octaves below the incoming 1024
    # Aligned to C, every 2^-6 is cut to 0; aligned among themselves they would sum to 0.5 and 1024.5 fits.
    assert wgmma_e4m3_dot(a, b).item() == 1024.0


def test_results_keep_13_fraction_bits_and_small_integers_are_exact(fresh_seed):
    a = torch.randn(4, 128, 128).to(torch.float8_e4m3fn).float()
    b = torch.randn(4, 128, 128).to(torch.float8_e4m3fn).float()
    out = wgmma_e4m3_dot(a, b)
    assert (out.view(torch.int32) & 0x3FF).eq(0).all()
    exact = a.double() @ b.double().transpose(-1, -2)
    scale = exact.abs().amax()
    # Each of the 4 instructions cuts up to 33 terms by under one quantum (2^-13 of its largest term) in the
    # same direction per sign: measured up to ~5 quanta of the largest score over 100 seeds; 12 leaves margin,
    # and an 11-bit model (4x the quantum) measures ~22.
    assert ((out.double() - exact).abs() <= 12 * 2.0**-13 * scale).all(), f"seed {fresh_seed}"
    ints = torch.randint(-3, 4, (2, 64, 128)).float()
    assert torch.equal(wgmma_e4m3_dot(ints, ints), ints @ ints.transpose(-1, -2))


def test_reference_with_wgmma_accumulation(fresh_seed):
    q, k, v = (torch.randn(1, 1000, 2, 128, dtype=torch.bfloat16) for _ in range(3))
    exact_sum = reference_attention(q, k, v)
    hardware_sum = reference_attention(q, k, v, accumulation="wgmma")
    # A few codes move by one: the kernel-vs-exact-reference gap measured on the H200 (2.4e-3 .. 4.8e-3).
    assert 1e-3 < rel_l2(hardware_sum, exact_sum) < 1e-2, f"seed {fresh_seed}"
    assert rel_l2(hardware_sum, exact_attention(q, k, v)) < 0.065


def test_bad_accumulation():
    q = torch.randn(1, 16, 1, 128)
    with pytest.raises(ValueError, match="accumulation must be one of 'exact', 'wgmma', got 'tf32'"):
        reference_attention(q, q, q, accumulation="tf32")


def test_incoming_accumulator_continues_the_chain(fresh_seed):
    """A sum split over two calls (the kernel's PV chain over two key tiles) equals one call over both."""
    a = torch.randn(3, 64, 256).to(torch.float8_e4m3fn).float()
    b = torch.randn(3, 72, 256).to(torch.float8_e4m3fn).float()
    first = wgmma_e4m3_dot(a[..., :128], b[..., :128])
    assert torch.equal(wgmma_e4m3_dot(a[..., 128:], b[..., 128:], first), wgmma_e4m3_dot(a, b))


def test_all_zero_terms_sum_to_zero():
    """Zero rows (padding queries, all-zero keys) must give 0, not NaN: 2^shift stays finite."""
    a = torch.zeros(2, 64, 128)
    a[1, :, :5] = torch.randn(64, 5).to(torch.float8_e4m3fn).float()
    b = torch.randn(2, 72, 128).to(torch.float8_e4m3fn).float()
    out = wgmma_e4m3_dot(a, b)
    assert not out.isnan().any() and (out[0] == 0).all() and out[1].abs().sum() > 0
    assert torch.equal(wgmma_e4m3_dot(a, torch.zeros_like(b)), torch.zeros(2, 64, 72))
