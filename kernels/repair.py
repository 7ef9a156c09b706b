"""V residual repair (PyTorch): what per-head quantization lost, which tokens get repair keys, and their rows.

Per head, the tokens of largest residual energy ``sum_c r_jc^2`` (optionally weighed by their ``attention_mass``)
become ``round(rho * S)`` extra keys: a copy of the token's quantized key with its block's K descale, and the value
row ``e4m3(r_j / d_V)`` in V's per-head scale (DESIGN.md section 2, item 8); exact ties go to the lower token
index, and the chosen tokens are listed in ascending order (``select_repair_tokens``). The reference and both
preparations take their repair keys from here. Tensors are head-major, ``(B, H, S, D)``.
"""

import torch

from .quant import BLOCK, softmax_scale_or_default, to_e4m3


def v_residual(v: torch.Tensor, v8: torch.Tensor, d_v: torch.Tensor) -> torch.Tensor:
    """What per-head quantization lost: ``r = V - d_V * V8`` in FP32, ``(B, H, S, D)``."""
    return v.float() - d_v[..., None, None] * v8.float()


def residual_energy(residual: torch.Tensor) -> torch.Tensor:
    """``sum_c r^2`` per token: ``(B, H, S)``. The fused preparation sums the same squares in another order."""
    return residual.square().sum(dim=-1)


def repair_count(seq_len: int, ratio: float) -> int:
    """Repair rows per head: ``round(ratio * S)``."""
    return int(round(ratio * seq_len))


REPAIR_RANKINGS = ("attention", "energy")
MASS_SAMPLE_ROWS = 64
"""Query rows, evenly spaced, whose attention estimates how much each key matters for repair ranking."""


def _sampled_scores(q_rows: torch.Tensor, k: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """``softmax_scale * q_rows . k^T`` in FP32 for ``(B, H, R, D)`` q_rows and ``(B, H, S, D)`` k: ``(B, H, R, S)``.

    Products of 16-bit floats are exact in FP32, so on CUDA the 16-bit GEMM with FP32 output computes the same
    sums as the FP32 one (up to order) straight from K's strided view: no FP32 copy of K.
    """
    if not (k.is_cuda and k.dtype in (torch.float16, torch.bfloat16)):
        return (q_rows.float() @ k.float().transpose(-1, -2)) * softmax_scale
    # One GEMM per batch: K's (H, S, D) view of diffusers' (S, H, D) layout has plain strides, (B, H) merged not.
    scores = [torch.bmm(rows, keys.transpose(-1, -2), out_dtype=torch.float32) for rows, keys in zip(q_rows, k)]
    return torch.stack(scores).mul_(softmax_scale)


def attention_mass(q: torch.Tensor, k: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """Mean squared softmax probability each key gets from ``MASS_SAMPLE_ROWS`` evenly spaced query rows
    (FP32 softmax on ``(B, H, S, D)`` q, k): ``(B, H, S_k)``.

    A residual ``r_j`` adds ``p_ij r_j`` to row i's error, so its squared error over rows goes as
    ``sum_i p_ij^2 |r_j|^2``.
    """
    count = min(MASS_SAMPLE_ROWS, q.shape[2])
    rows = torch.linspace(0, q.shape[2] - 1, count, device=q.device).round().long()
    probs = torch.softmax(_sampled_scores(q[:, :, rows], k, softmax_scale), dim=-1)
    # The norm reads the probabilities once; squaring them first would write and read them again.
    return torch.linalg.vector_norm(probs, dim=2).square() / count


ORDER_KEY_NAN = 0xFFFFFFFF
"""``order_key`` of every NaN: above every number, +inf's key 0xFF800000 included."""


def order_key(score: torch.Tensor) -> torch.Tensor:
    """Each FP32 score as an order-preserving unsigned 32-bit key, held in int64: ``(B, H, S)``.

    Larger scores get larger keys; every NaN gets ``ORDER_KEY_NAN`` (the largest key), -0.0 the key of +0.0. The
    key of a non-negative float is its bits with the sign bit set, of a negative one its bits inverted, so the
    keys order as the numbers do, -inf lowest. ``sm90.select`` computes the same key on the GPU.
    """
    bits = score.float().contiguous().view(torch.int32).long()  # sign-extended: negative floats < 0
    key = torch.where(bits < 0, -1 - bits, bits + 2**31)  # ~u for a negative float's bits u, u | 2^31 otherwise
    key = torch.where(score == 0, 2**31, key)  # -0.0 == +0.0
    return torch.where(score.isnan(), ORDER_KEY_NAN, key)


def select_repair_tokens(score: torch.Tensor, count: int) -> torch.Tensor:
    """Per head, the ``count`` tokens of largest ``score`` (B, H, S) fp32 (``repair_score``), in ascending token
    order: ``(B, H, count)`` int64.

    The rule, the same on every device (``sm90.select.SelectRepairTokens`` reproduces it bit for bit): scores
    order by ``order_key`` (NaN above +inf above every finite score, -0.0 equal to +0.0); among equal keys the
    lower token index ranks higher.
    """
    ranked = torch.sort(order_key(score), dim=-1, descending=True, stable=True).indices
    return ranked[..., :count].sort(dim=-1).values


def repair_score(
    energy: torch.Tensor, q: torch.Tensor, k: torch.Tensor, *, ranking: str, softmax_scale: float | None
) -> torch.Tensor:
    """What ranks the repair candidates, from their ``residual_energy`` (B, H, S) and ``(B, S, H, D)`` q, k: the
    energy itself (ranking "energy") or the energy times the ``attention_mass`` (ranking "attention";
    ``softmax_scale`` defaults to ``1 / sqrt(D)``): ``(B, H, S)`` fp32."""
    if ranking != "attention":
        return energy
    tau = softmax_scale_or_default(softmax_scale, q.shape[-1])
    return energy * attention_mass(q.transpose(1, 2), k.transpose(1, 2), tau)


def choose_repair_tokens(
    energy: torch.Tensor,
    count: int,
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    ranking: str,
    softmax_scale: float | None,
) -> torch.Tensor:
    """The repair tokens per head, from their ``residual_energy`` (B, H, S) and ``(B, S, H, D)`` q, k
    (``repair_score``, ``select_repair_tokens``): ``(B, H, count)`` int64, ascending."""
    score = repair_score(energy, q, k, ranking=ranking, softmax_scale=softmax_scale)
    return select_repair_tokens(score, count)


def gather_tokens(x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Rows ``tokens`` (B, H, count) of head-major ``x`` (B, H, S, D): ``(B, H, count, D)``."""
    return x.gather(2, tokens[..., None].expand(-1, -1, -1, x.shape[-1]))


def quantize_repair_rows(residual_rows: torch.Tensor, d_v: torch.Tensor) -> torch.Tensor:
    """Repair value rows ``e4m3(r_j / d_V)`` from the chosen tokens' residuals, in V's per-head scale:
    ``(B, H, count, D)``."""
    return to_e4m3(residual_rows / d_v[..., None, None])


def rank_repair_tokens(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    v8: torch.Tensor,
    d_v: torch.Tensor,
    count: int,
    *,
    ranking: str,
    softmax_scale: float | None,
) -> torch.Tensor:
    """The ``count`` repair tokens per head of ``(B, S, H, D)`` q, k, v quantized to head-major ``v8``, ``d_v``
    (``quant.quantize_inputs``), from residual energies summed by PyTorch: ``(B, H, count)`` int64, ascending."""
    energy = residual_energy(v_residual(v.transpose(1, 2), v8, d_v))
    return choose_repair_tokens(energy, count, q, k, ranking=ranking, softmax_scale=softmax_scale)


def repair_descales(d_k: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Each repair key's K descale, its token's block's: ``(B, H, count)``."""
    return d_k.gather(2, tokens // BLOCK)


def repair_values(v: torch.Tensor, v8_rows: torch.Tensor, tokens: torch.Tensor, d_v: torch.Tensor) -> torch.Tensor:
    """The repair value rows ``e4m3(r_j / d_V)`` of ``tokens`` (B, H, count), from ``(B, S, H, D)`` v and the
    tokens' quantized rows ``v8_rows`` (B, H, count, D): ``(B, H, count, D)`` float8_e4m3fn."""
    residual = v_residual(gather_tokens(v.transpose(1, 2), tokens), v8_rows, d_v)
    return quantize_repair_rows(residual, d_v)
