import os

import pytest
import torch


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
