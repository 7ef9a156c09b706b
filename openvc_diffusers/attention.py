"""``attention(q, k, v, config)``: one attention call routed by the policy, each fallback reason logged once."""

import logging

import torch

import openvc_kernels
from openvc_kernels.rotary import rotate_qk, tables_reason

from .backends import kernel_options, run_fa4, run_reference, run_sdpa
from .config import FA4, OpenVCConfig, load_config
from .policy import OPENVC_KERNEL, OPENVC_REFERENCE, Call, Decision, decide

logger = logging.getLogger("openvc_diffusers")
_said: set[str] = set()

REFERENCE_WARNING = (
    "Open-VC is running its PyTorch reference (no Hopper GPU here): the numerics of the FP8 kernel, "
    "without its speed."
)


# Under torch.compile this runs while tracing, not in the graph: no graph break at the logger, no guard on _said.
@torch.compiler.assume_constant_result
def warn_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        logger.warning(message)


OPENVC_BACKENDS = (OPENVC_KERNEL, OPENVC_REFERENCE)


def warn_reasons(decision: Decision) -> None:
    for reason in decision.reasons:
        warn_once(f"Open-VC fallback to {decision.backend}: {reason}")


def run_openvc(decision: Decision, config: OpenVCConfig, q, k, v, **shard_options):
    """An Open-VC call (the kernel, or its reference off the GPU) with the config's options; ``shard_options`` are
    the kernel API's keywords: for one K/V shard of a ring (``return_lse``, ``v_absmax``, ``k_mean``), or the
    kernel's ``rotary``. Returns what the kernel API returns: BF16 ``out``, or ``(out, lse)``."""
    warn_reasons(decision)
    if decision.backend == OPENVC_KERNEL:
        return openvc_kernels.attention(q, k, v, **kernel_options(config), **shard_options)
    warn_once(REFERENCE_WARNING)
    return run_reference(q, k, v, config, **shard_options)


def run(
    decision: Decision,
    config: OpenVCConfig,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    attention_backend=None,
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Run a decided call on (B, S, H, D) inputs; output in q's dtype and layout. ``rotary``: the (cos, sin) tables
    of a rotary embedding q and k still need (``rotate_qk``'s), which the Open-VC kernel applies in its preparation
    and every other backend first."""
    if rotary is not None and (decision.backend != OPENVC_KERNEL or tables_reason(q, k, *rotary) is not None):
        q, k = rotate_qk(q, k, *rotary)
        rotary = None
    if decision.backend in OPENVC_BACKENDS:
        options = {} if rotary is None else {"rotary": rotary}
        return run_openvc(decision, config, q, k, v, **options).to(q.dtype)
    warn_reasons(decision)
    if decision.backend == FA4:
        return run_fa4(q, k, v)
    return run_sdpa(q, k, v, attn_mask=attn_mask, attention_backend=attention_backend)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    config=None,
    *,
    attn_mask: torch.Tensor | None = None,
    is_cross: bool | None = None,
    layer: int | None = None,
    step: int | None = None,
) -> torch.Tensor:
    """Attention on diffusers-layout ``(B, S, H, D)`` tensors through the backend the policy picks.

    ``config`` is anything ``load_config`` takes. ``is_cross`` defaults to "k is not as long as q";
    ``layer`` and ``step`` (ints >= 0) let ``bf16_layers`` / ``bf16_steps`` apply. Bad q, k, v raise the same ``ValueError``
    whichever backend the policy would pick; a call that autograd records takes a backend with a gradient.
    """
    for name, index in (("layer", layer), ("step", step)):
        # A layer "3" would never match bf16_layers' 3: the call would silently take Open-VC.
        if index is not None and (isinstance(index, bool) or not isinstance(index, int) or index < 0):
            raise ValueError(f"{name} must be an int >= 0 or None, got {index!r}")
    if is_cross is not None and not isinstance(is_cross, bool):
        raise ValueError(f"is_cross must be True, False or None (k not as long as q), got {is_cross!r}")
    config = load_config(config)
    call = Call(q, k, v, is_cross=is_cross, has_mask=attn_mask is not None, layer=layer, step=step)
    return run(decide(config, call), config, q, k, v, attn_mask=attn_mask)
