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
    # Found as a top-level "kernels" (a checkout's root on sys.path: `python -m ...` or `python -c ...` there), where
    # transformers imports Hugging Face's package of that name (which it requires from 5.25 on). Our modules must not
    # run a second time under that name (the custom op would register again, bound to a second compile cache): the
    # name goes to Hugging Face's package where one is installed; else this module stays empty, without a __file__,
    # which transformers reads as a namespace package and ignores.
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _elsewhere = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != _checkout]
    _theirs = importlib.machinery.PathFinder.find_spec(__name__, _elsewhere)
    if _theirs is None:
        __file__ = None
    else:
        # The import system returns what sys.modules holds under the name once this module has run.
        sys.modules[__name__] = importlib.util.module_from_spec(_theirs)
        _theirs.loader.exec_module(sys.modules[__name__])
