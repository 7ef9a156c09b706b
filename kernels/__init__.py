"""Open-VC FP8 ExpCast attention kernels, imported as ``openvc_kernels``.

The PyTorch reference here is the oracle; the Hopper implementation lives in ``sm90``.
"""

from .expcast import expcast_decode, expcast_encode
from .merge import merge_attention
from .ops import attention, attention_prepared, prepare
from .reference import reference_attention, visiting_order
from .preparation import Prepared, PrepareOptions, prepare_reference
from .support import KernelUnavailableError, kernel_unavailable_reason

__all__ = [
    "KernelUnavailableError",
    "PrepareOptions",
    "Prepared",
    "attention",
    "attention_prepared",
    "expcast_decode",
    "expcast_encode",
    "kernel_unavailable_reason",
    "merge_attention",
    "prepare",
    "prepare_reference",
    "reference_attention",
    "visiting_order",
]
