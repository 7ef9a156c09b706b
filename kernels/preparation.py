"""What the sm90 forward kernel reads (``Prepared``), its options (``PrepareOptions``), and the preparation in
PyTorch: the bytes the fused preparation (``prep_ops``) must write, and the oracle its tests compare with.

Quantization is ``quant.quantize_inputs`` and the repair keys come from ``repair``, as in ``reference_attention``:
the reference, this preparation and the fused one's repair keys share that code.
"""

from typing import NamedTuple

import torch

from .quant import BLOCK, num_blocks, quantize_inputs, softmax_scale_or_default
from .repair import gather_tokens, rank_repair_tokens, repair_count, repair_descales, repair_values
from .sm90.layout import HEAD_DIM, pack_v, packed_position, padded_len

REPAIR_ROOM_ALIGN = BLOCK // 2
"""The repair keys' room is a multiple of 64 keys: whole tiles, and a last tile of 64 where the keys fit in it,
which the kernel runs as half a tile (``sm90.fwd.HALF_TILE_N``)."""


def repair_room(count: int) -> int:
    """Room for ``count`` repair keys after the real ones: ``count`` rounded up to a multiple of 64, the rest zero
    keys (which change no output: their V rows and ones rows are 0)."""
    return -(-count // REPAIR_ROOM_ALIGN) * REPAIR_ROOM_ALIGN


def preparation_may_rotate(repair_ranking: str, v_absmax, k_mean) -> bool:
    """Whether a preparation with these options reads q and k only to quantize them, so that it may rotate them
    as it does (``prep_ops.prepare(rotary=...)``): not for the "attention" ranking's scores, nor with a ring shard's
    shared scales (``v_absmax``, ``k_mean``), which were taken of the rotated keys."""
    return repair_ranking != "attention" and v_absmax is None and k_mean is None


class PrepareOptions(NamedTuple):
    """How q, k, v are prepared, as in ``reference_attention``: K smoothing, V residual repair (rho and the ranking
    of its candidates) and the softmax scale (default ``1 / sqrt(D)``), which the descale guards and the
    "attention" ranking use."""

    smooth_k: bool = False
    repair_ratio: float = 0.0
    repair_ranking: str = "energy"
    softmax_scale: float | None = None


class Prepared(NamedTuple):
    """Kernel inputs: FP8 bytes as uint8, FP32 descales, packed V; ``seqlen_k`` counts the real keys.

    q8 (B, H, Sq_pad, 128), d_q (B, H, n_q), k8 (B, H, Sk_pad + R, 128), d_k (B, H, n_k),
    v_packed (B, H, 136, Sk_pad + R), d_v (B, H), d_k_repair (B, H, R), tile_repair (B, H, R) int32; all
    contiguous. R (``repair_room``: a multiple of 64, 0 without V residual repair) counts the repair keys after the real ones
    (``write_repair_rows``): K rows of chosen tokens, each with its own block's descale in ``d_k_repair`` and its
    block's index in ``tile_repair`` (which piece of a split unit keeps it, ``split.py``), and their V residuals.
    """

    q8: torch.Tensor
    d_q: torch.Tensor
    k8: torch.Tensor
    d_k: torch.Tensor
    v_packed: torch.Tensor
    d_v: torch.Tensor
    d_k_repair: torch.Tensor
    tile_repair: torch.Tensor
    seqlen_k: int

    @property
    def repair_tiles(self) -> int:
        """The kernel's key tiles of repair keys, the last of them half a tile where R is an odd multiple of 64."""
        return num_blocks(self.d_k_repair.shape[-1])


def with_whole_repair_tiles(prepared: Prepared) -> Prepared:
    """``prepared`` with zero keys after its repair keys up to whole tiles (R a multiple of 128), so that the kernel
    runs no half tile: the same output bytes (tests and notes/probe_repair_tiles.py compare the two)."""
    extra = prepared.repair_tiles * BLOCK - prepared.d_k_repair.shape[-1]
    pad = torch.nn.functional.pad
    return prepared._replace(
        k8=pad(prepared.k8, (0, 0, 0, extra)), v_packed=pad(prepared.v_packed, (0, extra)),
        d_k_repair=pad(prepared.d_k_repair, (0, extra)), tile_repair=pad(prepared.tile_repair, (0, extra)),
    )


def write_repair_rows(prepared: Prepared, v: torch.Tensor, tokens: torch.Tensor) -> None:
    """Fill the R repair keys of ``prepared`` (real keys written, room for R after them) for ``tokens``
    (B, H, count <= R), from ``(B, S, H, 128)`` v: each token's K row and its block's descale, the FP8 bytes of
    ``r / d_V`` with ``r = V - d_V V8`` (V8 read back from packed V), 0 in the ones rows, zero keys (in tile 0)
    after them.
    """
    s_pad, count = padded_len(prepared.seqlen_k), tokens.shape[-1]
    k_rows = prepared.k8[:, :, s_pad:]
    k_rows[:, :, :count] = gather_tokens(prepared.k8, tokens)
    k_rows[:, :, count:] = 0
    prepared.d_k_repair[..., :count] = repair_descales(prepared.d_k, tokens)
    prepared.d_k_repair[..., count:] = 0
    prepared.tile_repair[..., :count] = tokens // BLOCK
    prepared.tile_repair[..., count:] = 0
    columns = packed_position(tokens)[:, :, None, :].expand(-1, -1, HEAD_DIM, -1)
    v8 = prepared.v_packed[:, :, :HEAD_DIM].gather(3, columns).transpose(2, 3).view(torch.float8_e4m3fn)
    # pack_v pads to whole tiles; R, a multiple of the 32-key chunk, takes whole chunks of them.
    room = prepared.d_k_repair.shape[-1]
    prepared.v_packed[..., s_pad:] = pack_v(repair_values(v, v8, tokens, prepared.d_v), ones=False)[..., :room]


def prepare_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    options: PrepareOptions = PrepareOptions(),
    *,
    v_absmax: torch.Tensor | None = None,
    k_mean: torch.Tensor | None = None,
) -> Prepared:
    """The preparation in PyTorch, from ``(B, S, H, 128)`` q, k, v: the bytes the fused kernels must write.
    The repair keys come from the residual energies summed by PyTorch. ``v_absmax`` and ``k_mean`` replace this
    call's own V absmax and (with ``smooth_k``) K mean, as in ``reference_attention``."""
    tau = softmax_scale_or_default(options.softmax_scale, q.shape[-1])
    q8, d_q, k8, d_k, v8, d_v = quantize_inputs(
        q, k, v, smooth_k=options.smooth_k, softmax_scale=tau, v_absmax=v_absmax, k_mean=k_mean
    )
    count = repair_count(k.shape[1], options.repair_ratio)
    room = repair_room(count)
    k8 = torch.nn.functional.pad(k8.view(torch.uint8), (0, 0, 0, room))
    prepared = Prepared(
        q8.view(torch.uint8),
        d_q.contiguous(),
        k8,
        d_k.contiguous(),
        torch.nn.functional.pad(pack_v(v8), (0, room)),
        d_v.contiguous(),
        d_k.new_empty(*d_k.shape[:2], room),
        torch.empty(*d_k.shape[:2], room, dtype=torch.int32, device=d_k.device),
        k.shape[1],
    )
    if count:
        tokens = rank_repair_tokens(
            q, k, v, v8, d_v, count, ranking=options.repair_ranking, softmax_scale=options.softmax_scale
        )
        write_repair_rows(prepared, v, tokens)
    return prepared
