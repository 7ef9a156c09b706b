"""FP8 E4M3 quantization of attention inputs, and V residual repair selection (PyTorch).

Q and K get one scale per 128-token block, V one scale per head (DESIGN.md section 2):
``a = max(absmax(x), 1e-12)``, ``x8 = e4m3_rne(clamp(x * (448 / a), -448, 448))``, descale ``d = a / 448``.
All tensors here are head-major, ``(B, H, S, D)``; the public entry points take diffusers' ``(B, S, H, D)``.
"""

import torch

FP8_MAX = 448.0
BLOCK = 128
"""Tokens per Q/K scale block, and the kernel's query and key tile."""
ABSMAX_FLOOR = 1e-12


def num_blocks(seq_len: int) -> int:
    return -(-seq_len // BLOCK)


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    """RNE to E4M3 after clamping: torch's cast turns out-of-range values into NaN, the hardware's saturates."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _scale_and_descale(absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    a = absmax.clamp(min=ABSMAX_FLOOR)
    # One IEEE division each, on every device: with a Python scalar on either side, torch divides by
    # multiplying with a reciprocal (on CUDA also for ``a / 448``), which differs in the last bit.
    fp8_max = torch.full_like(a, FP8_MAX)
    return fp8_max / a, a / fp8_max


def quantize_per_block(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, H, S, D)`` -> FP8 ``(B, H, S_pad, D)`` zero-padded to whole blocks, descales ``(B, H, n_blocks)``."""
    b, h, s, d = x.shape
    n = num_blocks(s)
    padded = torch.nn.functional.pad(x.float(), (0, 0, 0, n * BLOCK - s))
    blocks = padded.view(b, h, n, BLOCK, d)
    scale, descale = _scale_and_descale(blocks.abs().amax(dim=(3, 4)))
    x8 = _e4m3(blocks * scale[..., None, None]).view(b, h, n * BLOCK, d)
    return x8, descale


def quantize_per_head(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, H, S, D)`` -> FP8 ``(B, H, S, D)`` and descales ``(B, H)``."""
    x = x.float()
    scale, descale = _scale_and_descale(x.abs().amax(dim=(2, 3)))
    return _e4m3(x * scale[..., None, None]), descale


def smooth_keys(k: torch.Tensor) -> torch.Tensor:
    """K minus its per-channel mean over the sequence, per head, in FP32: ``(B, H, S, D)``.

    Every score of a query row moves by the same ``q . mean``, so softmax is unchanged in exact math, while
    the per-block K scales stop being set by channel offsets that video DiTs carry.
    """
    k = k.float()
    return k - k.mean(dim=2, keepdim=True)


def v_residual(v: torch.Tensor, v8: torch.Tensor, d_v: torch.Tensor) -> torch.Tensor:
    """What per-head quantization lost: ``r = V - d_V * V8`` in FP32, ``(B, H, S, D)``."""
    return v.float() - d_v[..., None, None] * v8.float()


def repair_count(seq_len: int, ratio: float) -> int:
    """Repair rows per head: ``round(ratio * S)``."""
    return int(round(ratio * seq_len))


REPAIR_RANKINGS = ("attention", "energy")
MASS_SAMPLE_ROWS = 64
"""Query rows, evenly spaced, whose attention estimates how much each key matters for repair ranking."""


def attention_mass(q: torch.Tensor, k: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """Mean squared softmax probability each key gets from ``MASS_SAMPLE_ROWS`` evenly spaced query rows
    (exact FP32 softmax on ``(B, H, S, D)`` q, k): ``(B, H, S_k)``.

    A residual ``r_j`` adds ``p_ij r_j`` to row i's error, so its squared error over rows goes as
    ``sum_i p_ij^2 |r_j|^2``.
    """
    rows = torch.linspace(0, q.shape[2] - 1, min(MASS_SAMPLE_ROWS, q.shape[2]), device=q.device).round().long()
    scores = (q[:, :, rows].float() @ k.float().transpose(-1, -2)) * softmax_scale
    return torch.softmax(scores, dim=-1).square().mean(dim=2)


def select_repair_tokens(residual: torch.Tensor, count: int, key_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Per head, the ``count`` tokens of largest residual energy ``sum_c r^2`` (times ``key_weight``, e.g. the
    ``attention_mass``, where given): ``(B, H, count)`` int64.

    Ties go to the lower token index (stable sort), so every implementation picks the same tokens.
    """
    energy = residual.square().sum(dim=-1)
    if key_weight is not None:
        energy = energy * key_weight
    order = torch.sort(energy, dim=-1, descending=True, stable=True).indices
    return order[..., :count]


def quantize_repair_rows(residual: torch.Tensor, tokens: torch.Tensor, d_v: torch.Tensor) -> torch.Tensor:
    """Repair value rows ``e4m3(r_j / d_V)`` of the chosen tokens, in V's per-head scale: ``(B, H, count, D)``."""
    d = residual.shape[-1]
    rows = residual.gather(2, tokens[..., None].expand(-1, -1, -1, d))
    return _e4m3(rows / d_v[..., None, None])
