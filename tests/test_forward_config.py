"""The forward kernel's configuration (no GPU, no cutlass): it names the compiled variant, and its defaults are
what the reference models."""

import dataclasses

import pytest

from openvc_kernels import wgmma
from openvc_kernels.sm90.config import ForwardConfig


def test_every_field_changes_the_cache_name():
    default = ForwardConfig()
    other = {"plain_order": True, "kv_stages": 2, "pingpong": False, "promote_every": 1, "write_lse": True}
    assert set(other) == {field.name for field in dataclasses.fields(ForwardConfig)}
    names = {default.cache_name} | {dataclasses.replace(default, **{k: v}).cache_name for k, v in other.items()}
    assert len(names) == 1 + len(other)
    assert all(name.replace("_", "").isalnum() for name in names)  # compile_cache's rule for names


def test_the_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ForwardConfig().pingpong = False


def test_the_reference_models_the_default_promotion():
    """``reference_attention(accumulation="wgmma")`` chains PV over ``wgmma.PV_PROMOTE_EVERY`` tiles: the kernel's
    default must be that value."""
    assert ForwardConfig().promote_every == wgmma.PV_PROMOTE_EVERY
