"""Helpers the tests share (fixtures stay in conftest.py)."""

import re

import pytest
import torch

POISON = 0x7F
"""E4M3 NaN, FP32 3.4e38: any output byte a kernel forgets to write shows up."""

needs_hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0), reason="needs a Hopper GPU"
)


def exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Float64 softmax attention on (B, S, H, D)."""
    q, k, v = (x.double().transpose(1, 2) for x in (q, k, v))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2)


def poisoned_prepared(prepared):
    """``prepared`` (a ``prep_ops.Prepared`` of fresh buffers) with every buffer filled with ``POISON`` bytes."""
    for t in prepared[:-1]:
        t.view(torch.uint8).fill_(POISON)
    return prepared


PTXAS_REMARKS = {"CUTE_DSL_COMPILER_OPT": "remarks{ptx}"}
"""Environment for a compile whose ptxas reports each kernel's registers and spills on stderr."""


def ptxas_spills(stderr: str) -> list[tuple[str, int, int]]:
    """Per kernel ptxas compiled, in order: its entry function's name (truncated by the DSL, so not always unique) and
    its spill stores and loads in bytes, from the report a compile with ``PTXAS_REMARKS`` writes to stderr. Spills
    exist only in SASS: PTX has no spill code."""
    report = re.findall(
        r"Compiling entry function '([^']+)'.*?(\d+) bytes spill stores, (\d+) bytes spill loads", stderr, re.S
    )
    return [(name, int(stores), int(loads)) for name, stores, loads in report]
