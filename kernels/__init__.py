"""Open-VC FP8 ExpCast attention kernels, imported as ``openvc_kernels``.

The PyTorch reference here is the oracle; the Hopper implementation lives in ``sm90``.
"""

if __name__ == "openvc_kernels":
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
else:
    # Found as a top-level "kernels" (a checkout's root on sys.path): transformers imports any "kernels" it finds,
    # taking it for the Hugging Face package of that name. Importing our modules a second time under that name would
    # register the custom op again, bound to a second compile cache; without a __file__ this module reads as a
    # namespace package, which transformers ignores.
    __file__ = None
