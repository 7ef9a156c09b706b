"""Open-VC FP8 ExpCast attention kernels, imported as ``openvc_kernels``.

The PyTorch reference here is the oracle; the Hopper implementation lives in ``sm90``.
"""

from .expcast import expcast_decode, expcast_encode
from .reference import reference_attention, visiting_order
from .support import kernel_unavailable_reason

__all__ = [
    "expcast_decode",
    "expcast_encode",
    "kernel_unavailable_reason",
    "reference_attention",
    "visiting_order",
]
