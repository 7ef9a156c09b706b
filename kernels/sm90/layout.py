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

import torch

from ..quant import BLOCK
from ..support import HEAD_DIM

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
