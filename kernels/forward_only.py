"""Open-VC attention has no backward: a gradient taken through it raises instead of coming out wrong.

Quantizing to FP8 and rounding scores to ExpCast codes are steps with zero derivative almost everywhere, so
autograd through the PyTorch reference would give Q and K exactly zero gradient; the kernel's custom op has no
derivative at all. Both keep their forward and give their output a backward that raises ``FORWARD_ONLY``.
"""

from collections.abc import Callable

import torch

FORWARD_ONLY = (
    "Open-VC FP8 attention is forward-only: it has no gradient (FP8 rounding and ExpCast codes have zero "
    "derivative). Run it under torch.no_grad() / torch.inference_mode(), or use openvc_diffusers' processor or "
    "backend, which send every call that needs gradients to the BF16 fallback by themselves."
)


def needs_grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd would record a call on these inputs."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


class _RaiseOnBackward(torch.autograd.Function):
    """Runs ``compute(q, k, v)`` (without recording it) as one node whose backward raises."""

    @staticmethod
    def forward(ctx, compute: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        return compute(q, k, v)

    @staticmethod
    def backward(ctx, *grad_outputs: torch.Tensor):
        raise RuntimeError(FORWARD_ONLY)


def forward_only(compute: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """``compute(q, k, v)`` (a tensor, or a tuple of them: the output and its log-sum-exp); where autograd records
    the call, a backward through any of its outputs raises ``FORWARD_ONLY``."""
    if needs_grad(q, k, v):
        return _RaiseOnBackward.apply(compute, q, k, v)
    return compute(q, k, v)


def raise_on_backward(ctx, *grad_outputs: torch.Tensor):
    """The backward registered for the kernel's custom ops."""
    raise RuntimeError(FORWARD_ONLY)
