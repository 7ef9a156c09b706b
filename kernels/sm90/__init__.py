"""The Hopper (sm_90a) implementation: packed-V layout, ExpCast softmax, fused preparation, forward kernel.
``layout``, ``config``, ``barriers`` and ``target`` are importable without nvidia-cutlass-dsl."""

from .layout import KEY_PERMUTATION, PV_N, Prepared, pack_v, prepare_reference

__all__ = ["KEY_PERMUTATION", "PV_N", "Prepared", "pack_v", "prepare_reference"]
