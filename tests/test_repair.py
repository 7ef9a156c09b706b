"""The repair keys of the preparation (``preparation.write_repair_rows``) hold exactly the reference's choices, packed as
the kernel reads them (no GPU: on the PyTorch preparation)."""

import pytest
import torch

from openvc_kernels.preparation import PrepareOptions, prepare_reference
from openvc_kernels.quant import BLOCK, quantize_per_head
from openvc_kernels.repair import choose_repair_tokens, gather_tokens, quantize_repair_rows, residual_energy, v_residual
from openvc_kernels.sm90.layout import CHUNK, E4M3_ONE, HEAD_DIM, chunk_key, pack_v, packed_position


def test_packed_position_inverts_chunk_key():
    positions = torch.arange(4 * CHUNK)
    keys = torch.tensor([p // CHUNK * CHUNK + chunk_key(p % CHUNK) for p in range(4 * CHUNK)])
    assert torch.equal(packed_position(keys), positions)


@pytest.mark.parametrize("ranking", ["attention", "energy"])
def test_repair_keys_follow_the_reference_choice(fresh_seed, ranking):
    q, k, v = (torch.randn(2, 700, 3, HEAD_DIM) for _ in range(3))
    v[:, ::97] *= 30  # a few tokens with large residuals
    prepared = prepare_reference(q, k, v)
    repaired = prepare_reference(q, k, v, PrepareOptions(repair_ratio=0.2, repair_ranking=ranking, softmax_scale=0.1))

    count, s_pad = 140, prepared.k8.shape[2]  # round(0.2 * 700) repair keys, after the 768 padded real ones
    v_heads = v.transpose(1, 2)
    v8, d_v = quantize_per_head(v_heads)
    residual = v_residual(v_heads, v8, d_v)
    tokens = choose_repair_tokens(residual_energy(residual), count, q, k, ranking=ranking, softmax_scale=0.1)
    assert torch.isin(tokens[..., 0], torch.arange(0, 700, 97)).all(), "an outlier token ranks first"

    assert repaired.repair_tiles == 2 and repaired.k8.shape[2] == s_pad + 2 * BLOCK
    assert torch.equal(repaired.k8[:, :, :s_pad], prepared.k8)
    assert torch.equal(repaired.k8[:, :, s_pad : s_pad + count], gather_tokens(prepared.k8, tokens))
    assert (repaired.k8[:, :, s_pad + count :] == 0).all()
    assert torch.equal(repaired.d_k_repair[..., :count], prepared.d_k.gather(2, tokens // BLOCK))
    assert (repaired.d_k_repair[..., count:] == 0).all()
    assert torch.equal(repaired.tile_repair[..., :count], (tokens // BLOCK).int())
    assert (repaired.tile_repair[..., count:] == 0).all()

    values = repaired.v_packed[..., s_pad:]
    assert torch.equal(values, pack_v(quantize_repair_rows(gather_tokens(residual, tokens), d_v), ones=False))
    assert (values[:, :, HEAD_DIM:] == 0).all(), "repair keys must stay out of the denominator"
    assert ((prepared.v_packed[:, :, HEAD_DIM:] == E4M3_ONE).sum(-1) == 700).all()  # the real keys' ones
    assert torch.equal(repaired.v_packed[..., :s_pad], prepared.v_packed)
    for name in ("q8", "d_q", "d_k", "d_v"):
        assert torch.equal(getattr(repaired, name), getattr(prepared, name)), name


def test_no_repair_keys_at_ratio_zero():
    q = torch.randn(1, 300, 2, HEAD_DIM)
    prepared = prepare_reference(q, q, q, PrepareOptions(repair_ratio=0.0))
    assert prepared.repair_tiles == 0 and prepared.k8.shape[2] == prepared.v_packed.shape[3] == 3 * BLOCK


def test_prepare_rejects_bad_arguments_before_any_launch():
    from openvc_kernels import prepare

    q = torch.randn(1, 300, 2, HEAD_DIM, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"repair_ratio must be a finite number in \[0, 0.5\], got 0.7"):
        prepare(q, q, q, repair_ratio=0.7)
    with pytest.raises(ValueError, match="repair_ranking must be one of 'attention', 'energy', got 'mass'"):
        prepare(q, q, q, repair_ranking="mass")
    with pytest.raises(ValueError, match="runs on CUDA devices, inputs are on cpu"):
        prepare(q, q, q)
