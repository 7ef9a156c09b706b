"""The Hopper (sm_90a) device code: packed-V layout, inline PTX, ExpCast softmax, fused preparation, forward kernel.
Their host side (compilation, torch wrappers) is ``ops`` and ``prep_ops``. ``layout``, ``config``, ``barriers`` and
``target`` are importable without nvidia-cutlass-dsl."""

from .layout import KEY_PERMUTATION, PV_N, pack_v

__all__ = ["KEY_PERMUTATION", "PV_N", "pack_v"]
