import os

import pytest
import torch

from openvc_diffusers.metrics import rel_l2  # noqa: F401  (tests import it from here)


@pytest.fixture
def fresh_seed() -> int:
    """A new seed every run (the kernel must be right on any input); reported on failure."""
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    return seed


def exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Float64 softmax attention on (B, S, H, D)."""
    q, k, v = (x.double().transpose(1, 2) for x in (q, k, v))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2)
