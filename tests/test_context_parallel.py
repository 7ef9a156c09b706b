"""Context parallelism on gloo: Ulysses x ring over 2 and 4 CPU processes give the single-process output of the tiny
Wan model, through ``apply``'s YAML settings and through diffusers' ``enable_parallelism``; misuse fails clearly."""

import functools
import gc
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from diffusers.models._modeling_parallel import ContextParallelConfig

import openvc_diffusers
import openvc_kernels
from openvc_diffusers.metrics import rel_l2
from openvc_diffusers.parallel import check_call
from openvc_diffusers.ring import attend_key_shards, ring_attention
from openvc_kernels.quant import mean_keys, mean_tokens
from openvc_diffusers.tiny import tiny_wan_inputs, tiny_wan_transformer
from test_families import build as build_family
from test_families import forward as forward_family

POLICIES = {
    "plain": {"min_tokens": 0, "repair_ratio": 0},
    # Repair on: each ring shard repairs its own keys, so the result depends on the sharding (ring.py).
    "repair": {"min_tokens": 0, "repair_ratio": 0.02},
    # Every self-attention call falls back: the ring gathers K and V and SDPA attends over all of them.
    "sdpa": {"backends": ["sdpa"]},
    # 512 tokens take Open-VC: the policy counts the whole sequence's queries, not a ring shard's 256.
    "min_tokens": {"min_tokens": 512, "repair_ratio": 0},
}
POLICY = POLICIES["plain"]
CALLS = {("self", "openvc-reference"): 2, ("cross", "sdpa"): 2}
RING_TOLERANCE = 1e-2
"""rel-L2 of the model's output, ring against one process. Measured 2026-12-01 (CPU, gloo): 0 (bitwise) with Ulysses
alone; with a ring, repair off, 2.0-2.1e-3 at 512 tokens (ring shards of 256, whole 128-token blocks) and 6.3-6.4e-3
at 160 (shards of 80), for R = 2 and 4, both routes; repair on (rho 0.02) the same to 1e-4. Not bitwise: each shard's
ExpCast codes sit on its own row max (ring.py); at the attention call that is 1.8-2.4% rel-L2 against the unsplit call,
as far from float64 attention as it (notes/ring_accuracy.py)."""


def video_inputs(frames: int, height: int, width: int) -> dict:
    """The tiny model's inputs with a latent of ``frames x height x width`` (tokens: frames x height/2 x width/2)."""
    inputs = tiny_wan_inputs()
    g = torch.Generator().manual_seed(1)
    inputs["hidden_states"] = torch.randn(1, 4, frames, height, width, generator=g)
    return inputs


ALIGNED = (2, 32, 32)
"""512 tokens: 128 per rank in a world of 4, 256 per ring shard at ring degree 2; multiples of 128, so every Q and K
block is the unsplit call's."""
TINY = (2, 16, 20)
"""The tiny model's own 160 tokens: ring shards of 80, whose blocks end where the unsplit call's do not."""
UNEVEN = (1, 14, 18)
"""63 tokens: no degree above 1 divides them."""


def _forward(model, shape) -> torch.Tensor:
    with torch.no_grad():
        return model(**video_inputs(*shape))[0]


def _error(model, shape) -> str | None:
    try:
        _forward(model, shape)
    except ValueError as e:
        return str(e)
    return None


def _through_apply(degrees, policy, shapes) -> dict:
    model = tiny_wan_transformer()
    ulysses, ring = degrees
    config = {**POLICIES[policy], "parallel": {"ulysses_degree": ulysses, "ring_degree": ring}}
    processor = openvc_diffusers.apply(model, config)
    outs = {shape: _forward(model, shape) for shape in shapes}
    return {"outs": outs, "calls": dict(processor.calls), "uneven": _error(model, UNEVEN)}


def _through_enable_parallelism(degrees, policy, shapes) -> dict:
    openvc_diffusers.register(POLICIES[policy])
    model = tiny_wan_transformer()
    model.set_attention_backend("openvc")
    ulysses, ring = degrees
    # diffusers picks the device as rank % torch.accelerator.device_count(), which is 0 without an accelerator.
    with mock.patch.object(torch.accelerator, "device_count", return_value=1):
        model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=ulysses, ring_degree=ring))
    return {"outs": {shape: _forward(model, shape) for shape in shapes}}


def _ltx_through_apply(degrees, policy, shapes) -> dict:
    """The tiny LTX model, whose plan splits the prompt and its mask over the ranks as well: its cross-attention
    gathers them (``backend.gather_context``)."""
    ulysses, ring = degrees
    model, inputs = build_family("ltx")
    openvc_diffusers.apply(model, {**POLICIES[policy], "parallel": {"ulysses_degree": ulysses, "ring_degree": ring}})
    out = forward_family(model, inputs)
    # LTX's output is diffusers' gather itself, a collective's tensor that torch.save cannot write: its plain tensor.
    return {"out": out.wait() if hasattr(out, "wait") else out}


def _enable_parallelism_then_apply(degrees, policy, shapes) -> dict:
    """diffusers shards the model first, then ``apply`` installs Open-VC: a config without parallel degrees keeps that
    sharding, one with them is refused (it would shard the model twice)."""
    model = tiny_wan_transformer()
    ulysses, ring = degrees
    with mock.patch.object(torch.accelerator, "device_count", return_value=1):
        model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=ulysses, ring_degree=ring))
    try:
        openvc_diffusers.apply(model, {"parallel": {"ulysses_degree": ulysses, "ring_degree": ring}})
        twice = None
    except ValueError as e:
        twice = str(e)
    processor = openvc_diffusers.apply(model, POLICIES[policy])
    outs = {shape: _forward(model, shape) for shape in shapes}
    return {"outs": outs, "calls": dict(processor.calls), "twice": twice}


def _enable_parallelism_refusal(degrees, policy, shapes) -> str | None:
    try:
        _through_enable_parallelism(degrees, policy, shapes)
    except (ValueError, RuntimeError) as e:
        return str(e)
    return None


def _apply_refusal(degrees, policy, shapes) -> str | None:
    ulysses, ring = degrees
    try:
        openvc_diffusers.apply(tiny_wan_transformer(), {"parallel": {"ulysses_degree": ulysses, "ring_degree": ring}})
    except ValueError as e:
        return str(e)
    return None


def attention_inputs(seed: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v ``(1, 512, 2, 128)`` bf16, K with channel offsets (which smoothing takes out)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 512, 2, 128, generator=g) for _ in range(3))
    k[..., :4] += 5
    return tuple(x.bfloat16() for x in (q, k, v))


RING_OPTIONS = {"smooth_k": True, "repair_ratio": 0.0, "window": 4}


def _ring_call(degrees, policy, shapes) -> torch.Tensor:
    """``ring_attention`` on this rank's shard of ``attention_inputs``, through the reference."""
    q, k, v = (x.chunk(dist.get_world_size(), dim=1)[dist.get_rank()] for x in attention_inputs())
    shard = functools.partial(openvc_kernels.reference_attention, **RING_OPTIONS)
    return ring_attention(q, k, v, dist.group.WORLD, shard, smooth_k=True)


ROUTES = {
    "apply": _through_apply,
    "enable_parallelism": _through_enable_parallelism,
    "enable_parallelism_then_apply": _enable_parallelism_then_apply,
    "ltx_apply": _ltx_through_apply,
    "apply_refused": _apply_refusal,
    "enable_parallelism_refused": _enable_parallelism_refusal,
    "ring_call": _ring_call,
}


def _worker(rank: int, world: int, out_dir: str, runs: list) -> None:
    # A file rendezvous: no port to race for with other processes on the machine.
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        results = {name: ROUTES[route](degrees, policy, shapes) for name, route, degrees, policy, shapes in runs}
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        # The model's hooks and device meshes hold the process group in reference cycles: left to interpreter exit,
        # gloo's group is torn down too late and aborts the worker now and then (both tests then error).
        gc.collect()
        dist.destroy_process_group()


def _spawn(tmp_path_factory, world: int, runs: list) -> list[dict]:
    out_dir = tmp_path_factory.mktemp(f"world{world}")
    mp.spawn(_worker, args=(world, str(out_dir), runs), nprocs=world)
    return [torch.load(out_dir / f"rank{rank}.pt") for rank in range(world)]


@pytest.fixture(scope="module")
def one_process():
    """The single-process outputs the sharded runs must give, per policy and input shape."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    expected = {}
    for name in ("plain", "repair", "sdpa"):
        model = tiny_wan_transformer()
        openvc_diffusers.apply(model, POLICIES[name])
        expected[name] = {shape: _forward(model, shape) for shape in (ALIGNED, TINY)}
    model, inputs = build_family("ltx")
    openvc_diffusers.apply(model, POLICIES["plain"])
    expected["ltx"] = forward_family(model, inputs)
    torch.set_num_threads(threads)
    return expected


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    runs = [
        ("ulysses", "apply", (2, 1), "plain", [TINY]),
        ("ulysses_backend", "enable_parallelism", (2, 1), "plain", [TINY]),
        ("ring", "apply", (1, 2), "plain", [ALIGNED, TINY]),
        ("ring_backend", "enable_parallelism", (1, 2), "plain", [ALIGNED]),
        ("ulysses_then_apply", "enable_parallelism_then_apply", (2, 1), "plain", [TINY]),
        ("ring_then_apply", "enable_parallelism_then_apply", (1, 2), "plain", [ALIGNED]),
        ("ltx_ulysses", "ltx_apply", (2, 1), "plain", []),
        ("ltx_ring", "ltx_apply", (1, 2), "plain", []),
        ("ring_repair", "apply", (1, 2), "repair", [ALIGNED]),
        ("ring_sdpa", "apply", (1, 2), "sdpa", [ALIGNED]),
        ("ring_min_tokens", "apply", (1, 2), "min_tokens", [ALIGNED]),
        ("ring_call", "ring_call", (1, 2), None, []),
        ("too_many", "apply_refused", (2, 2), None, []),
    ]
    return _spawn(tmp_path_factory, 2, runs)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    runs = [
        ("unified", "apply", (2, 2), "plain", [ALIGNED]),
        ("unified_backend", "enable_parallelism", (2, 2), "plain", [ALIGNED]),
        ("too_few", "apply_refused", (1, 2), None, []),
        # Last: the ranks outside diffusers' mesh of 2 fail as it is built, the two inside at the first attention call.
        ("too_few_backend", "enable_parallelism_refused", (1, 2), "plain", [ALIGNED]),
    ]
    return _spawn(tmp_path_factory, 4, runs)


def test_ulysses_is_bitwise_one_process(two_ranks, one_process):
    """Ulysses moves whole heads: the attention of each is the single process's, bit for bit."""
    for saved in two_ranks:
        for name in ("ulysses", "ulysses_backend", "ulysses_then_apply"):
            assert torch.equal(saved[name]["outs"][TINY], one_process["plain"][TINY]), name
        assert saved["ulysses"]["calls"] == saved["ulysses_then_apply"]["calls"] == CALLS
        assert saved["ulysses"]["uneven"] == "parallel.ulysses_degree 2 must divide the 63 video tokens of this call"


def test_ring_matches_one_process(two_ranks, one_process):
    for saved in two_ranks:
        runs = (("ring", "plain"), ("ring_backend", "plain"), ("ring_then_apply", "plain"), ("ring_repair", "repair"))
        for name, policy in runs:
            for shape, out in saved[name]["outs"].items():
                error = rel_l2(out, one_process[policy][shape])
                assert error < RING_TOLERANCE, (name, shape, error)
        assert saved["ring"]["calls"] == {key: 2 * count for key, count in CALLS.items()}
        assert saved["ring"]["uneven"] == "parallel.ring_degree 2 must divide the 63 video tokens of this call"


def test_ring_decides_on_the_whole_sequence(two_ranks, one_process):
    """A backend other than Open-VC attends over the gathered K/V: SDPA's output is the single process's (measured
    2026-12-01: bitwise); ``min_tokens`` counts the whole sequence."""
    for saved in two_ranks:
        assert torch.equal(saved["ring_sdpa"]["outs"][ALIGNED], one_process["sdpa"][ALIGNED])
        assert saved["ring_sdpa"]["calls"] == {("self", "sdpa"): 2, ("cross", "sdpa"): 2}
        assert saved["ring_min_tokens"]["calls"] == CALLS
        assert torch.equal(saved["ring_min_tokens"]["outs"][ALIGNED], saved["ring"]["outs"][ALIGNED])


def test_ring_call_is_its_shards_merged(two_ranks):
    """Over gloo, each rank's ring output is exactly its query shard against every K/V shard with V's absmax and the
    unsplit call's K mean (over every 8th key of the whole sequence), merged (the all-reduces of two ranks add in one
    order): bitwise."""
    q, k, v = attention_inputs()
    shards = k.chunk(2, dim=1)
    sums = [mean_keys(shard, r * shards[0].shape[1]).sum(dim=1, dtype=torch.float32) for r, shard in enumerate(shards)]
    k_mean = (sums[0] + sums[1]) / mean_tokens(k.shape[1])
    v_absmax = v.abs().amax(dim=(1, 3)).float()
    shard = functools.partial(openvc_kernels.reference_attention, **RING_OPTIONS)
    for rank, saved in enumerate(two_ranks):
        q_shard = q.chunk(2, dim=1)[rank]
        k_shards, v_shards = k.chunk(2, dim=1), v.chunk(2, dim=1)
        expected = attend_key_shards(q_shard, k_shards, v_shards, shard, v_absmax=v_absmax, k_mean=k_mean)
        assert torch.equal(saved["ring_call"], expected)


def test_ulysses_times_ring_matches_one_process(four_ranks, one_process):
    for saved in four_ranks:
        for name in ("unified", "unified_backend"):
            error = rel_l2(saved[name]["outs"][ALIGNED], one_process["plain"][ALIGNED])
            assert error < RING_TOLERANCE, (name, error)
        assert saved["unified"]["calls"] == CALLS
        expected = "parallel.ulysses_degree 2 x parallel.ring_degree 2 must divide the 63 video tokens of this call"
        assert saved["unified"]["uneven"] == expected


def test_a_sharded_prompt_is_gathered_for_cross_attention(two_ranks, one_process):
    """LTX's plan splits the prompt and its mask too: with each rank's query shard attending to its own part of the
    prompt alone, the output was 6.5% (rel-L2) off the single process's with Ulysses (measured 2026-12-05, before
    ``gather_context``); now Ulysses gives it bit for bit, and the ring within its tolerance. (diffusers' own
    attention under the same sharding fails on the mask's shape there, diffusers 0.42.1.)"""
    for saved in two_ranks:
        assert torch.equal(saved["ltx_ulysses"]["out"], one_process["ltx"])
        error = rel_l2(saved["ltx_ring"]["out"], one_process["ltx"])
        assert error < RING_TOLERANCE, error


def test_a_sharded_model_is_not_sharded_again(two_ranks):
    for saved in two_ranks:
        for name, degrees in (("ulysses_then_apply", "ulysses_degree 2"), ("ring_then_apply", "ring_degree 2")):
            assert saved[name]["twice"] == (
                "WanTransformer3DModel is sharded already (by enable_parallelism or an earlier apply); "
                f"parallel.{degrees} would shard it twice: load the model again, or apply a config without parallel "
                "degrees (the sharding in place is kept)"
            )


def test_degrees_must_make_the_world(two_ranks, four_ranks):
    for saved in two_ranks:
        assert saved["too_many"].startswith(
            "parallel.ulysses_degree 2 x parallel.ring_degree 2 needs a world of 4 processes, got 2: "
            "launch with `torchrun --nproc-per-node 4"
        )
    for saved in four_ranks:
        assert saved["too_few"].startswith("parallel.ring_degree 2 needs a world of 2 processes, got 4")
    for saved in four_ranks[:2]:
        assert saved["too_few_backend"] == (
            "ContextParallelConfig(ulysses_degree=1, ring_degree=2) shards over 2 processes, the world has 4: "
            "make ulysses_degree x ring_degree the world size (or pass a mesh)"
        )


def test_context_parallel_needs_torch_distributed():
    with pytest.raises(ValueError, match="torchrun --nproc-per-node 4"):
        openvc_diffusers.apply(tiny_wan_transformer(), {"parallel": {"ulysses_degree": 2, "ring_degree": 2}})


def test_heads_must_divide_by_the_degree():
    with pytest.raises(ValueError, match="ulysses_degree 3 must divide WanTransformer3DModel's 2 attention heads"):
        openvc_diffusers.apply(tiny_wan_transformer(), {"parallel": {"ulysses_degree": 3}})


def test_sharded_calls_are_checked():
    q = torch.randn(1, 8, 2, 128)
    with pytest.raises(ValueError, match="takes the even shards .* got ulysses_anything=True, ring_anything=False"):
        check_call(ContextParallelConfig(ulysses_degree=2, ulysses_anything=True), q, q, q)
    cp = ContextParallelConfig(ulysses_degree=4)
    cp._world_size = 4  # as setup() records it
    with pytest.raises(ValueError, match="ulysses_degree 4 must divide the 2 attention heads of this call"):
        check_call(cp, q, q, q)
    cp = ContextParallelConfig(ulysses_degree=2)
    cp._world_size = 2
    check_call(cp, q, q, q)
    with pytest.raises(RuntimeError, match="context parallelism is forward-only: run the sharded model under"):
        check_call(cp, q.requires_grad_(), q, q)
