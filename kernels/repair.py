"""V residual repair rows for the sm90 kernel, chosen and packed in PyTorch on the inputs' device.

Per (batch, head): the residual ``r = V - d_V * V8``, the ``round(rho * S)`` tokens of largest residual energy
(weighted by ``quant.attention_mass`` with the "attention" ranking), and for them one extra key each after the
real keys: the token's quantized K row, its block's K descale, and ``e4m3(r / d_V)`` as the value, with 0 in the
ones rows so that repair adds to the numerator only. The same choices as ``reference_attention``; no host
synchronisation, so a call can be captured in a CUDA graph.
"""

import torch

from .quant import (
    BLOCK,
    attention_mass,
    num_blocks,
    quantize_per_head,
    quantize_repair_rows,
    repair_count,
    select_repair_tokens,
    v_residual,
)
from .sm90.layout import Prepared, pack_v


def add_repair_rows(
    prepared: Prepared,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    ratio: float,
    ranking: str,
    softmax_scale: float,
) -> Prepared:
    """``prepared`` (for ``(B, S, H, 128)`` q, k, v) with the repair keys appended, padded to whole tiles by zero
    keys (zero V, zero ones: they add nothing); ``prepared`` itself when ``ratio`` picks no token."""
    count = repair_count(k.shape[1], ratio)
    if count == 0:
        return prepared
    v_heads = v.transpose(1, 2)
    v8, d_v = quantize_per_head(v_heads)
    residual = v_residual(v_heads, v8, d_v)
    mass = attention_mass(q.transpose(1, 2), k.transpose(1, 2), softmax_scale) if ranking == "attention" else None
    tokens = select_repair_tokens(residual, count, mass)

    pad = num_blocks(count) * BLOCK - count
    k_rows = prepared.k8.gather(2, tokens[..., None].expand(-1, -1, -1, prepared.k8.shape[-1]))
    k8 = torch.cat([prepared.k8, torch.nn.functional.pad(k_rows, (0, 0, 0, pad))], dim=2)
    d_k_repair = torch.nn.functional.pad(prepared.d_k.gather(2, tokens // BLOCK), (0, pad))
    v_rows = pack_v(quantize_repair_rows(residual, tokens, d_v), ones=False)
    v_packed = torch.cat([prepared.v_packed, v_rows], dim=3)
    return prepared._replace(k8=k8, v_packed=v_packed, d_k_repair=d_k_repair.contiguous())
