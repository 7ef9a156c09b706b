"""Which backend takes an attention call, and why: the config's chains plus what each backend can take."""

import json
from dataclasses import dataclass

import torch

import openvc_kernels
from openvc_kernels.forward_only import needs_grad
from openvc_kernels.ops import build_failure, rotates_in_preparation
from openvc_kernels.support import HEAD_DIM
from openvc_kernels.validation import INPUT_DTYPES, check_qkv

from .backends import fa4_unavailable_reason
from .config import FA4, OPENVC, SDPA, OpenVCConfig

OPENVC_KERNEL = OPENVC
"""The FP8 ExpCast kernel on Hopper."""
OPENVC_REFERENCE = "openvc-reference"
"""The PyTorch reference of the same kernel: Open-VC numerics off the GPU, slowly."""


@dataclass(frozen=True)
class Call:
    """What the policy needs to know of one attention call on diffusers-layout ``(B, S, H, D)`` tensors. Built,
    it has passed ``check_qkv``: a bad call fails alike whichever backend would take it."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    is_cross: bool | None = None
    """None: cross-attention if the keys are not as many as the queries."""
    has_mask: bool = False
    layer: int | None = None
    step: int | None = None
    query_tokens: int | None = None
    """The query tokens of the whole call, where ``query`` is one ring shard of it (``min_tokens`` applies to the
    whole: every rank then decides alike, as one process would); None: ``query``'s own."""
    rotary: bool = False
    """The call brings the tables of a rotary embedding that the query and key still need (``attention.run``)."""

    def __post_init__(self):
        check_qkv(self.query, self.key, self.value)
        if self.is_cross is None:
            object.__setattr__(self, "is_cross", self.key.shape[1] != self.query.shape[1])
        if self.query_tokens is None:
            object.__setattr__(self, "query_tokens", self.query.shape[1])

    @property
    def needs_grad(self) -> bool:
        """Autograd records this call: Open-VC is forward-only, so it must take a backend with a gradient."""
        return needs_grad(self.query, self.key, self.value)


@dataclass(frozen=True)
class Decision:
    backend: str
    reasons: tuple[str, ...] = ()
    """Why each backend before it in the chain was passed over."""


def chain(config: OpenVCConfig, call: Call) -> tuple[tuple[str, ...], str | None]:
    """The backends to try in order, and why Open-VC was left out of it, if it was."""
    if call.is_cross:
        fallbacks = tuple(b for b in config.backends if b not in (OPENVC, config.cross_attention))
        return (config.cross_attention,) + fallbacks, None
    if call.needs_grad:
        return _without_openvc(config), "autograd needs gradients through this call; Open-VC is forward-only"
    if call.layer is not None and call.layer in config.bf16_layers:
        return _without_openvc(config), f"layer {call.layer} is in bf16_layers"
    if call.step is not None and call.step in config.bf16_steps:
        return _without_openvc(config), f"denoising step {call.step} is in bf16_steps"
    return config.backends, None


def _without_openvc(config: OpenVCConfig) -> tuple[str, ...]:
    return tuple(b for b in config.backends if b != OPENVC)


def openvc_unavailable_reason(config: OpenVCConfig, call: Call) -> str | None:
    q = call.query
    if q.shape[-1] != HEAD_DIM:
        # Checked on every device: off the GPU the reference stands in for the kernel and takes what it takes.
        return f"head_dim {q.shape[-1]}; Open-VC takes head_dim {HEAD_DIM}"
    if q.dtype not in INPUT_DTYPES:
        return f"dtype {q.dtype}; Open-VC takes {', '.join(str(d).removeprefix('torch.') for d in INPUT_DTYPES)}"
    if call.has_mask:
        return "an attention mask was given; Open-VC takes unmasked attention"
    if not call.is_cross and call.query_tokens < config.min_tokens:
        return f"{call.query_tokens} query tokens < min_tokens {config.min_tokens}"
    if q.device.type == "cpu":
        return None  # the reference runs anywhere
    # HEAD_DIM, not q.shape[-1] (checked above): with dynamic=True that is symbolic, and so would be the options read
    # from the config; the constant lookup below takes constants (the options as text).
    return kernel_unavailable_reason(q.device, q.dtype, HEAD_DIM, config.kernel_options_text, call.rotary)


@torch.compiler.assume_constant_result
def kernel_unavailable_reason(
    device: torch.device, dtype: torch.dtype, head_dim: int, kernel_options_text: str, rotary: bool = False
) -> str | None:
    """Why the Hopper kernel cannot take queries of this device, dtype and head dim with these options
    (``OpenVCConfig.kernel_options_text``; ``openvc_kernels.kernel_unavailable_reason``), or why its kernels cannot
    be built here (compiled on the first call that asks: a failure then falls back, logged once, instead of failing
    the call). torch.compile runs this while tracing and keeps the answer (the tensor's guards cover the first
    three) instead of tracing it: its package lookup is a graph break at every call with torch 2.11."""
    reason = openvc_kernels.kernel_unavailable_reason(device, dtype, head_dim)
    if reason is not None:
        return reason
    options = json.loads(kernel_options_text)
    return build_failure(
        dtype,
        plain_order=options["window"] is None,
        smooth_k=options["smooth_k"],
        repair=options["repair_ratio"] > 0,
        rotary=rotary and rotates_in_preparation(False, options["repair_ranking"], None, None),
    )


def decide(config: OpenVCConfig, call: Call) -> Decision:
    backends, skipped = chain(config, call)
    reasons = [skipped] if skipped else []
    for name in backends:
        if name == OPENVC:
            reason = openvc_unavailable_reason(config, call)
            if reason is None:
                on_cpu = call.query.device.type == "cpu"
                return Decision(OPENVC_REFERENCE if on_cpu else OPENVC_KERNEL, tuple(reasons))
        elif name == FA4:
            reason = fa4_unavailable_reason(call.query, call.has_mask)
            if reason is None:
                return Decision(FA4, tuple(reasons))
        else:
            return Decision(SDPA, tuple(reasons))
        reasons.append(f"{name}: {reason}")
    raise AssertionError("unreachable: the config guarantees sdpa ends every chain")
