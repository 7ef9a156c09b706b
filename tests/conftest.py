import os
import sys
from pathlib import Path

# `python -m pytest` puts the checkout's root on sys.path, where the folder kernels/ (installed as openvc_kernels)
# would stand in for Hugging Face's `kernels` package, which transformers (5.25 and later) imports whenever it is
# installed, and which it requires: every import of diffusers' models would fail. The tests import the installed
# packages, never the root's folders.
ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != ROOT]

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture
def fresh_seed() -> int:
    """A new seed every run (the kernel must be right on any input); reported on failure."""
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    return seed


@pytest.fixture
def one_thread():
    """One torch thread: tiny models' ops are too small to gain from threads, and OpenMP threads waiting on
    each other on a busy 2-core machine make a call 10-20x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def fresh_dynamo():
    """torch.compile as in a new process: compiled code of earlier tests (the same forward functions, on other
    models) would count towards the recompile limit, and their graph breaks towards Dynamo's counters."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()
