"""The forward kernel's compile-time configuration: one frozen object per compiled variant, which also names the
variant in the compile cache. Importable without nvidia-cutlass-dsl."""

import dataclasses
from dataclasses import dataclass

from ..wgmma import PV_PROMOTE_EVERY


@dataclass(frozen=True)
class ForwardConfig:
    """Every constructor argument of ``ExpCastAttentionSm90``; the defaults are the shipped kernel (notes/kernel.md
    has the measurements behind them, notes/probe_*.py vary them)."""

    plain_order: bool = False
    """Visit the key tiles 0 .. n-1 (``window=None``) instead of in mid-window order."""
    kv_stages: int = 3
    """Depth of the K and V TMA pipelines (shared-memory stages of each)."""
    pingpong: bool = True
    """The two consumer warpgroups take turns issuing their wgmmas, so one's softmax runs while the other's matrix
    products occupy the tensor cores."""
    promote_every: int = PV_PROMOTE_EVERY
    """Key tiles the PV wgmma adds up before its sum moves into FP32 registers: the FP8 wgmma adds with ~14
    significant bits, so summing PV over all tiles in it would drop small products. ``reference_attention(...,
    accumulation="wgmma", promote_every=...)`` follows the same value (both default to ``wgmma.PV_PROMOTE_EVERY``)."""
    write_lse: bool = False
    """Also write each row's log-sum-exp (``expcast.row_lse``) to the ``lse`` argument; without it the kernel does
    not take that argument, and its code is the kernel's without the knob."""

    @property
    def cache_name(self) -> str:
        """The compile cache's name of this variant: every field, so that no two configs share a compiled kernel."""
        values = (f"{field.name}{int(getattr(self, field.name))}" for field in dataclasses.fields(self))
        return "_".join(["attention", *values])
