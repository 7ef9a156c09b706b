"""Ulysses on gloo: two CPU processes give the single-process output; misuse fails with a clear error."""

import gc
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from openvc_diffusers.metrics import rel_l2

import openvc_diffusers
from openvc_diffusers.parallel import heads_to_sequence, sequence_to_heads
from openvc_diffusers.tiny import tiny_wan_inputs, tiny_wan_transformer

DEGREE = 2
CONFIG = {"min_tokens": 0, "parallel": {"ulysses_degree": DEGREE}}


def _worker(rank: int, out_dir: str, seed: int) -> None:
    # A file rendezvous: no port to race for with other processes on the machine.
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=DEGREE)
    torch.set_num_threads(1)
    try:
        # The exchange alone: a sequence shard -> all of the sequence for half the heads, and back.
        torch.manual_seed(seed)
        full = torch.randn(2, 8 * DEGREE, 4, 16)
        shard = full.chunk(DEGREE, dim=1)[rank]
        heads = sequence_to_heads(shard, dist.group.WORLD)
        torch.save(
            {"heads": heads, "back": heads_to_sequence(heads, dist.group.WORLD), "shard": shard},
            f"{out_dir}/exchange{rank}.pt",
        )

        model = tiny_wan_transformer()
        processor = openvc_diffusers.apply(model, CONFIG)
        with torch.no_grad():
            out = model(**tiny_wan_inputs())[0]
            uneven = tiny_wan_inputs()
            uneven["hidden_states"] = uneven["hidden_states"][:, :, :1, :14, :18]  # 7 x 9 = 63 tokens
            try:
                model(**uneven)
                error = None
            except ValueError as e:
                error = str(e)
        torch.save({"out": out, "calls": dict(processor.calls), "error": error}, f"{out_dir}/model{rank}.pt")
    finally:
        # The model's hooks and device meshes hold the process group in reference cycles: left to interpreter exit,
        # gloo's group is torn down too late and aborts the worker now and then (both tests then error).
        gc.collect()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("ulysses")
    seed = int.from_bytes(os.urandom(4), "little")
    mp.spawn(_worker, args=(str(out_dir), seed), nprocs=DEGREE)
    torch.manual_seed(seed)
    full = torch.randn(2, 8 * DEGREE, 4, 16)
    return out_dir, full


def test_exchange_moves_heads_and_sequence(two_ranks):
    out_dir, full = two_ranks
    for rank in range(DEGREE):
        saved = torch.load(out_dir / f"exchange{rank}.pt")
        assert torch.equal(saved["heads"], full.chunk(DEGREE, dim=2)[rank])
        assert torch.equal(saved["back"], saved["shard"])


def test_two_ranks_match_one_process(two_ranks):
    out_dir, _ = two_ranks
    model = tiny_wan_transformer()
    single = openvc_diffusers.apply(model, {"min_tokens": 0})
    with torch.no_grad():
        expected = model(**tiny_wan_inputs())[0]
    for rank in range(DEGREE):
        saved = torch.load(out_dir / f"model{rank}.pt")
        # Each rank attends over the whole sequence for its head, through the reference.
        assert saved["calls"] == {("self", "openvc-reference"): 2, ("cross", "sdpa"): 2}
        assert rel_l2(saved["out"], expected) < 1e-6
        assert saved["error"] == "parallel.ulysses_degree 2 must divide the 63 video tokens of this call"
    assert single.calls == {("self", "openvc-reference"): 2, ("cross", "sdpa"): 2}


def test_ulysses_needs_torch_distributed():
    with pytest.raises(ValueError, match="torchrun --nproc-per-node 2"):
        openvc_diffusers.apply(tiny_wan_transformer(), CONFIG)


def test_heads_must_divide_by_the_degree():
    with pytest.raises(ValueError, match="ulysses_degree 3 must divide WanTransformer3DModel's 2 attention heads"):
        openvc_diffusers.apply(tiny_wan_transformer(), {"parallel": {"ulysses_degree": 3}})
