"""The kernel's repair keys (kernels/repair.py) hold exactly the reference's choices, packed as the kernel reads
them (no GPU: on the PyTorch preparation)."""

import pytest
import torch

from openvc_kernels.quant import (
    BLOCK,
    attention_mass,
    quantize_per_head,
    quantize_repair_rows,
    select_repair_tokens,
    v_residual,
)
from openvc_kernels.repair import add_repair_rows
from openvc_kernels.sm90.layout import E4M3_ONE, HEAD_DIM, pack_v, prepare_reference


@pytest.mark.parametrize("ranking", ["attention", "energy"])
def test_repair_keys_follow_the_reference_choice(fresh_seed, ranking):
    q, k, v = (torch.randn(2, 700, 3, HEAD_DIM) for _ in range(3))
    v[:, ::97] *= 30  # a few tokens with large residuals
    prepared = prepare_reference(q, k, v)
    repaired = add_repair_rows(prepared, q, k, v, ratio=0.2, ranking=ranking, softmax_scale=0.1)

    count, s_pad = 140, prepared.k8.shape[2]  # round(0.2 * 700) repair keys, after the 768 padded real ones
    v_heads = v.transpose(1, 2)
    v8, d_v = quantize_per_head(v_heads)
    residual = v_residual(v_heads, v8, d_v)
    mass = attention_mass(q.transpose(1, 2), k.transpose(1, 2), 0.1) if ranking == "attention" else None
    tokens = select_repair_tokens(residual, count, mass)

    assert repaired.repair_tiles == 2 and repaired.k8.shape[2] == s_pad + 2 * BLOCK
    assert torch.equal(repaired.k8[:, :, :s_pad], prepared.k8)
    chosen_k = prepared.k8.gather(2, tokens[..., None].expand(-1, -1, -1, HEAD_DIM))
    assert torch.equal(repaired.k8[:, :, s_pad : s_pad + count], chosen_k)
    assert (repaired.k8[:, :, s_pad + count :] == 0).all()
    assert torch.equal(repaired.d_k_repair[..., :count], prepared.d_k.gather(2, tokens // BLOCK))
    assert (repaired.d_k_repair[..., count:] == 0).all()

    values = repaired.v_packed[..., s_pad:]
    assert torch.equal(values, pack_v(quantize_repair_rows(residual, tokens, d_v), ones=False))
    assert (values[:, :, HEAD_DIM:] == 0).all(), "repair keys must stay out of the denominator"
    assert ((prepared.v_packed[:, :, HEAD_DIM:] == E4M3_ONE).sum(-1) == 700).all()  # the real keys' ones
    assert torch.equal(repaired.v_packed[..., :s_pad], prepared.v_packed)


def test_no_repair_keys_at_ratio_zero():
    q = torch.randn(1, 300, 2, HEAD_DIM)
    prepared = prepare_reference(q, q, q)
    assert add_repair_rows(prepared, q, q, q, ratio=0.0, ranking="energy", softmax_scale=0.1) is prepared
    assert prepared.repair_tiles == 0


def test_prepare_rejects_bad_arguments_before_any_launch():
    from openvc_kernels import prepare

    q = torch.randn(1, 300, 2, HEAD_DIM, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"repair_ratio must be a finite number in \[0, 0.5\], got 0.7"):
        prepare(q, q, q, repair_ratio=0.7)
    with pytest.raises(ValueError, match="repair_ranking must be one of 'attention', 'energy', got 'mass'"):
        prepare(q, q, q, repair_ranking="mass")
    with pytest.raises(ValueError, match="runs on CUDA devices, inputs are on cpu"):
        prepare(q, q, q)
