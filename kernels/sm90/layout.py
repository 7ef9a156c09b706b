"""Packed V for the sm90 kernel: key-contiguous, key-permuted, with ones rows for the denominator.

FP8 ``wgmma`` reads B K-major only, so O = P V needs V with the keys contiguous: packed V is
``(B, H, HEAD_DIM + ONES_ROWS, S_pad)`` uint8 (E4M3 bytes), one row per value channel.

Rows ``HEAD_DIM .. HEAD_DIM + 7`` hold 1.0 for every real key and 0 for padding, so the PV product
(N = 136) puts ``l = sum of the FP8 probabilities`` in accumulator columns 128..135: every lane of a
quad owns one of them, the sum is the exact bytes that fed PV, and rescaling O rescales it too.
Repair keys (V residual repair, after the real keys) carry 0 there, which keeps them out of the denominator.

Key permutation. Per 32-key chunk, the S accumulator (m64nNk32, f32) gives lane ``t = lane % 4`` the
columns ``2t + e + 8c`` (e = 0, 1; c = 0..3) of its two rows; the E4M3 A operand of the PV wgmma wants
that lane to hold k positions ``4t + b + 16h`` (b = 0..3; h = 0, 1) as bytes b of register h. The kernel
packs, for each h, the codes of columns ``2t + {0, 1} + 8 * {2h, 2h + 1}`` into register h (byte b = e + 2 *
(c % 2)), so A position ``p`` carries the code of key ``chunk_key(p)``; packed V stores key
``chunk_key(p)`` at position ``p`` and the product is unchanged. ``test_sm90_compile`` checks this
against the tiled MMA's printed layouts.
"""

from typing import NamedTuple

import torch

from ..quant import (
    BLOCK,
    choose_repair_tokens,
    gather_tokens,
    quantize_inputs,
    quantize_repair_rows,
    repair_count,
    residual_energy,
    softmax_scale_or_default,
    v_residual,
)

HEAD_DIM = 128
ONES_ROWS = 8
"""Rows of 1.0 after the value channels: the wgmma N grows by 8 (its granule) to 136."""
PV_N = HEAD_DIM + ONES_ROWS
E4M3_ONE = 0x38
"""1.0 in E4M3 (exponent 7 = bias, mantissa 0)."""
CHUNK = 32
"""Keys per FP8 wgmma k-block: the permutation repeats every 32 keys."""


def chunk_key(position: int) -> int:
    """The key (0..31 within its chunk) whose code the PV A operand carries at k ``position``."""
    lane, byte, half = (position % 16) // 4, position % 4, position // 16
    return 2 * lane + byte % 2 + 8 * (byte // 2) + 16 * half


KEY_PERMUTATION = tuple(chunk_key(p) for p in range(CHUNK))


def packed_position(keys: torch.Tensor) -> torch.Tensor:
    """The packed-V column of each key index (int tensor): the inverse of ``chunk_key`` within each chunk.

    Key ``b0 + 2 lane + 8 b1 + 16 half`` sits at position ``b0 + 2 b1 + 4 lane + 16 half``; integer ops only, so
    no index table is copied to the device (this runs inside CUDA-graph captures).
    """
    b0, lane, b1, half = keys & 1, (keys >> 1) & 3, (keys >> 3) & 1, (keys >> 4) & 1
    return (keys & ~(CHUNK - 1)) + b0 + 2 * b1 + 4 * lane + 16 * half


def padded_len(seq_len: int) -> int:
    return -(-seq_len // BLOCK) * BLOCK


def pack_v(v8: torch.Tensor, *, ones: bool = True) -> torch.Tensor:
    """``(B, H, S, 128)`` float8_e4m3fn per-head-quantized V -> packed ``(B, H, 136, S_pad)`` uint8.

    Byte-exact: value bytes are copied, never converted; padding keys (>= S) are all zero. ``ones=False``
    leaves the ones rows 0 for every key (repair rows: numerator only).
    """
    if v8.dim() != 4 or v8.shape[-1] != HEAD_DIM:
        raise ValueError(f"pack_v takes (B, H, S, {HEAD_DIM}) V, got shape {tuple(v8.shape)}")
    if v8.dtype != torch.float8_e4m3fn:
        raise ValueError(f"pack_v takes float8_e4m3fn V, got {v8.dtype}")
    batch, heads, seq_len, _ = v8.shape
    s_pad = padded_len(seq_len)
    rows = torch.zeros(batch, heads, s_pad, PV_N, dtype=torch.uint8, device=v8.device)
    rows[:, :, :seq_len, :HEAD_DIM] = v8.view(torch.uint8)
    if ones:
        rows[:, :, :seq_len, HEAD_DIM:] = E4M3_ONE
    # chunk_key as a view: keys (half, b1, lane, b0) -> positions (half, lane, b1, b0); no index tensor, so
    # no host-to-device copy (this runs inside CUDA-graph captures).
    rows = rows.view(batch, heads, s_pad // CHUNK, 2, 2, 4, 2, PV_N).transpose(4, 5)
    return rows.reshape(batch, heads, s_pad, PV_N).transpose(2, 3).contiguous()


class Prepared(NamedTuple):
    """Kernel inputs: FP8 bytes as uint8, FP32 descales, packed V; ``seqlen_k`` counts the real keys.

    q8 (B, H, Sq_pad, 128), d_q (B, H, n_q), k8 (B, H, Sk_pad + R, 128), d_k (B, H, n_k),
    v_packed (B, H, 136, Sk_pad + R), d_v (B, H), d_k_repair (B, H, R); all contiguous. R (a multiple of 128,
    0 without V residual repair) counts the repair keys after the real ones (``write_repair_rows``): K
    rows of chosen tokens, each with its own block's descale in ``d_k_repair``, and their V residuals.
    """

    q8: torch.Tensor
    d_q: torch.Tensor
    k8: torch.Tensor
    d_k: torch.Tensor
    v_packed: torch.Tensor
    d_v: torch.Tensor
    d_k_repair: torch.Tensor
    seqlen_k: int

    @property
    def repair_tiles(self) -> int:
        return self.d_k_repair.shape[-1] // BLOCK


def write_repair_rows(prepared: Prepared, v: torch.Tensor, tokens: torch.Tensor) -> None:
    """Fill the R repair keys of ``prepared`` (real keys written, room for R after them) for ``tokens``
    (B, H, count <= R), from ``(B, S, H, 128)`` v: each token's K row and its block's descale, the FP8 bytes of
    ``r / d_V`` with ``r = V - d_V V8`` (V8 read back from packed V), 0 in the ones rows, zero keys after them.
    """
    s_pad, count = padded_len(prepared.seqlen_k), tokens.shape[-1]
    k_rows = prepared.k8[:, :, s_pad:]
    k_rows[:, :, :count] = gather_tokens(prepared.k8, tokens)
    k_rows[:, :, count:] = 0
    prepared.d_k_repair[..., :count] = prepared.d_k.gather(2, tokens // BLOCK)
    prepared.d_k_repair[..., count:] = 0
    columns = packed_position(tokens)[:, :, None, :].expand(-1, -1, HEAD_DIM, -1)
    v8 = prepared.v_packed[:, :, :HEAD_DIM].gather(3, columns).transpose(2, 3).view(torch.float8_e4m3fn)
    residual = v_residual(gather_tokens(v.transpose(1, 2), tokens), v8, prepared.d_v)
    prepared.v_packed[..., s_pad:] = pack_v(quantize_repair_rows(residual, prepared.d_v), ones=False)


def prepare_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    smooth_k: bool = False,
    repair_ratio: float = 0.0,
    repair_ranking: str = "energy",
    softmax_scale: float | None = None,
) -> Prepared:
    """The preparation in PyTorch, from ``(B, S, H, 128)`` q, k, v: the bytes the fused kernels must write.
    Options as in ``reference_attention``; the repair keys come from the residual energies summed by PyTorch."""
    tau = softmax_scale_or_default(softmax_scale, q.shape[-1])
    q8, d_q, k8, d_k, v8, d_v = quantize_inputs(q, k, v, smooth_k=smooth_k, softmax_scale=tau)
    count = repair_count(k.shape[1], repair_ratio)
    room = padded_len(count)
    k8 = torch.nn.functional.pad(k8.view(torch.uint8), (0, 0, 0, room))
    prepared = Prepared(
        q8.view(torch.uint8),
        d_q.contiguous(),
        k8,
        d_k.contiguous(),
        torch.nn.functional.pad(pack_v(v8), (0, room)),
        d_v.contiguous(),
        d_k.new_empty(*d_k.shape[:2], room),
        k.shape[1],
    )
    if count:
        energy = residual_energy(v_residual(v.transpose(1, 2), v8, d_v))
        tokens = choose_repair_tokens(energy, count, q, k, ranking=repair_ranking, softmax_scale=softmax_scale)
        write_repair_rows(prepared, v, tokens)
    return prepared
