"""The attention backends a call can take, each with the reason it cannot take a given call.

All take and return diffusers' ``(B, S, H, D)`` layout.
"""

import functools
import importlib.util
import json

import torch
from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry, dispatch_attention_fn

import openvc_kernels

from .config import OPENVC

FA4_DTYPES = (torch.float16, torch.bfloat16)
FA4_MAX_HEAD_DIM = 256


# torch.compile runs this while tracing and keeps the answer instead of tracing it: it would trace through the
# cache into importlib's find_spec, a graph break at every call with torch 2.11.
@torch.compiler.assume_constant_result
def fa4_installed() -> bool:
    return _fa4_found()


@functools.cache
def _fa4_found() -> bool:
    find = importlib.util.find_spec
    return find("flash_attn") is not None and find("flash_attn.cute") is not None


def fa4_unavailable_reason(q: torch.Tensor, has_mask: bool) -> str | None:
    if not fa4_installed():
        return "flash-attn-4 is not installed (pip install 'openvc-diffusers[fa4]')"
    if q.device.type != "cuda":
        return f"FlashAttention-4 needs a CUDA device, inputs are on {q.device}"
    if torch.cuda.get_device_capability(q.device)[0] < 9:
        return f"FlashAttention-4 needs Hopper or newer, {torch.cuda.get_device_name(q.device)} is older"
    if q.dtype not in FA4_DTYPES:
        return f"FlashAttention-4 takes fp16/bf16, inputs are {q.dtype}"
    if q.shape[-1] > FA4_MAX_HEAD_DIM:
        return f"FlashAttention-4 takes head_dim <= {FA4_MAX_HEAD_DIM}, got {q.shape[-1]}"
    if has_mask:
        return "FlashAttention-4 takes no attention mask"
    return None


def run_fa4(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    from flash_attn.cute import flash_attn_func

    out = flash_attn_func(q, k, v)
    return out[0] if isinstance(out, tuple) else out  # some releases return (out, lse)


def run_sdpa(q, k, v, attn_mask=None, attention_backend=None) -> torch.Tensor:
    """diffusers' own dispatch (``attention_backend``, None for the active one), so output is identical to the stock
    processors'. Where that would be the "openvc" backend itself, diffusers' native attention."""
    if attention_backend is None:
        attention_backend = _AttentionBackendRegistry._active_backend
    if attention_backend == OPENVC:  # the diffusers backend this package registers bears the policy's name
        attention_backend = AttentionBackendName.NATIVE
    return dispatch_attention_fn(q, k, v, attn_mask=attn_mask, backend=attention_backend)


# torch.compile runs this while tracing and keeps the answer: traced with dynamic=True, the config's floats
# (repair_ratio) would become symbolic inputs, which the kernel's argument checks (math.isfinite) cannot take.
# It takes the options as text, which torch.compile passes as a constant (the frozen config itself it cannot pass
# with torch 2.11), and returns a tuple of pairs (a dict result would be guarded on, which its source cannot be).
@torch.compiler.assume_constant_result
def _kernel_option_items(text: str) -> tuple:
    return tuple(json.loads(text).items())


def kernel_options(config) -> dict:
    """``config.kernel_options``, as constants."""
    return dict(_kernel_option_items(config.kernel_options_text))


def run_reference(q, k, v, config, **shard_options):
    """The reference with the config's Open-VC settings and ``shard_options`` (``attention.run_openvc``)."""
    return openvc_kernels.reference_attention(q, k, v, **kernel_options(config), **shard_options)
