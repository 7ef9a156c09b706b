"""The repair keys of the preparation (``preparation.write_repair_rows``) hold exactly the reference's choices, packed as
the kernel reads them (no GPU: on the PyTorch preparation)."""

import math

import pytest
import torch

from openvc_kernels.preparation import PrepareOptions, prepare_reference, repair_room, with_whole_repair_tiles
from openvc_kernels.quant import BLOCK, quantize_per_head
from openvc_kernels.repair import (
    ORDER_KEY_NAN,
    choose_repair_tokens,
    gather_tokens,
    order_key,
    quantize_repair_rows,
    repair_score,
    residual_energy,
    select_repair_tokens,
    v_residual,
)
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
    energy = residual_energy(residual)
    tokens = choose_repair_tokens(energy, count, q, k, ranking=ranking, softmax_scale=0.1)
    best = repair_score(energy, q, k, ranking=ranking, softmax_scale=0.1).argmax(-1, keepdim=True)
    assert torch.isin(best, torch.arange(0, 700, 97)).all(), "an outlier token scores highest"
    assert (tokens == best).any(-1).all(), "the best token is chosen"
    assert (tokens.diff(dim=-1) > 0).all(), "ascending"

    room = repair_room(count)  # 192: a whole tile and a half one
    assert repaired.repair_tiles == 2 and repaired.k8.shape[2] == s_pad + room == s_pad + 3 * BLOCK // 2
    assert torch.equal(repaired.k8[:, :, :s_pad], prepared.k8)
    assert torch.equal(repaired.k8[:, :, s_pad : s_pad + count], gather_tokens(prepared.k8, tokens))
    assert (repaired.k8[:, :, s_pad + count :] == 0).all()
    assert torch.equal(repaired.d_k_repair[..., :count], prepared.d_k.gather(2, tokens // BLOCK))
    assert (repaired.d_k_repair[..., count:] == 0).all()
    assert torch.equal(repaired.tile_repair[..., :count], (tokens // BLOCK).int())
    assert (repaired.tile_repair[..., count:] == 0).all()

    values = repaired.v_packed[..., s_pad:]
    assert values.shape[-1] == room
    packed = pack_v(quantize_repair_rows(gather_tokens(residual, tokens), d_v), ones=False)
    assert torch.equal(values, packed[..., :room]) and (packed[..., room:] == 0).all()
    assert (values[:, :, HEAD_DIM:] == 0).all(), "repair keys must stay out of the denominator"
    assert ((prepared.v_packed[:, :, HEAD_DIM:] == E4M3_ONE).sum(-1) == 700).all()  # the real keys' ones
    assert torch.equal(repaired.v_packed[..., :s_pad], prepared.v_packed)
    for name in ("q8", "d_q", "d_k", "d_v"):
        assert torch.equal(getattr(repaired, name), getattr(prepared, name)), name


@pytest.mark.parametrize(
    "count,room,tiles", [(0, 0, 0), (1, 64, 1), (64, 64, 1), (65, 128, 1), (128, 128, 1), (164, 192, 2), (300, 320, 3)]
)
def test_repair_room_is_whole_tiles_and_a_half_tile_where_the_keys_fit(count, room, tiles):
    """R rounds the count up to 64 keys: the kernel runs a last tile of 64 keys as half a tile."""
    assert repair_room(count) == room
    q, k, v = (torch.randn(1, 640, 1, HEAD_DIM) for _ in range(3))
    repaired = prepare_reference(q, k, v, PrepareOptions(repair_ratio=count / 640))
    assert repaired.repair_tiles == tiles
    assert repaired.k8.shape[2] == repaired.v_packed.shape[3] == 640 + room
    assert repaired.d_k_repair.shape[-1] == repaired.tile_repair.shape[-1] == room
    whole = with_whole_repair_tiles(repaired)  # zero keys up to whole tiles, the rest the same
    assert whole.repair_tiles == tiles and whole.d_k_repair.shape[-1] == tiles * BLOCK
    for name in ("k8", "v_packed", "d_k_repair", "tile_repair"):
        ends = getattr(repaired, name).shape[-2 if name == "k8" else -1]
        kept = getattr(whole, name)[:, :, :ends] if name == "k8" else getattr(whole, name)[..., :ends]
        added = getattr(whole, name)[:, :, ends:] if name == "k8" else getattr(whole, name)[..., ends:]
        assert torch.equal(kept, getattr(repaired, name)) and (added == 0).all(), name


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


def _chosen_by_the_rule(row: list[float], count: int) -> list[int]:
    """``select_repair_tokens``' rule, written out: NaN above everything, +inf next, -0.0 == +0.0, ties to the
    lower index; the chosen tokens ascending."""
    rank = sorted(range(len(row)), key=lambda i: (math.isnan(row[i]), 0.0 if math.isnan(row[i]) else row[i], -i))
    return sorted(rank[::-1][:count])


def _tied_scores(shape, generator) -> torch.Tensor:
    values = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1.0, 1.0000001, -2.0, 1e-40, 7.5])
    pick = torch.randint(len(values), shape, generator=generator)
    return values[pick]


@pytest.mark.parametrize("seq_len", [1, 2, 7, 37, 130, 1000])
def test_select_repair_tokens_follows_the_rule(fresh_seed, seq_len):
    generator = torch.Generator().manual_seed(fresh_seed)
    for flavour in ("ties", "ties and noise"):
        score = _tied_scores((2, 3, seq_len), generator)
        if flavour == "ties and noise":
            noisy = torch.rand(score.shape, generator=generator) < 0.5
            score = torch.where(noisy, torch.randn(score.shape, generator=generator), score)
        for count in sorted({1, max(1, seq_len // 3), max(1, seq_len // 2), seq_len}):
            tokens = select_repair_tokens(score, count)
            assert tokens.shape == (2, 3, count) and tokens.dtype == torch.int64
            for b in range(2):
                for h in range(3):
                    want = _chosen_by_the_rule(score[b, h].tolist(), count)
                    assert tokens[b, h].tolist() == want, f"{flavour}, count {count}, head {(b, h)} (seed {fresh_seed})"


def test_select_repair_tokens_nan_first_then_inf_then_lower_index():
    score = torch.tensor([[[1.0, float("inf"), float("nan"), 1.0, -0.0, float("nan"), float("inf"), 0.0, 1.0]]])
    assert select_repair_tokens(score, 2).tolist() == [[[2, 5]]]
    assert select_repair_tokens(score, 3).tolist() == [[[1, 2, 5]]]
    assert select_repair_tokens(score, 5).tolist() == [[[0, 1, 2, 5, 6]]]
    assert select_repair_tokens(score, 7).tolist() == [[[0, 1, 2, 3, 5, 6, 8]]]
    assert select_repair_tokens(score, 8).tolist() == [[[0, 1, 2, 3, 4, 5, 6, 8]]], "-0.0 ties +0.0: lower index"
    # A negative NaN (sign bit set) is a NaN like any other.
    negative_nan = torch.tensor([0x7FC00000 | -(2**31)], dtype=torch.int32).view(torch.float32)
    assert select_repair_tokens(torch.cat([torch.tensor([5.0]), negative_nan])[None, None], 1).tolist() == [[[1]]]


def test_order_key_orders_as_the_numbers():
    ladder = [-float("inf"), -3e38, -1.0, -1e-45, 0.0, 1e-45, 1e-38, 1.0, 3e38, float("inf")]
    keys = order_key(torch.tensor(ladder)).tolist()
    assert keys == sorted(keys) and len(set(keys)) == len(keys)
    assert all(0 <= key < ORDER_KEY_NAN for key in keys)
    specials = order_key(torch.tensor([-0.0, 0.0, float("nan"), -float("nan")])).tolist()
    assert specials == [2**31, 2**31, ORDER_KEY_NAN, ORDER_KEY_NAN]
