"""The sm90 preparation kernels: compile for sm_90a on any machine (CPU part), and on a Hopper GPU give
byte-identical results to the PyTorch quantization and packing (``quant``, ``layout.pack_v``, ``preparation``)."""

import itertools
import json
import os
import subprocess
import sys

import pytest
import torch

from openvc_kernels.preparation import Prepared, PrepareOptions, prepare_reference, write_repair_rows
from openvc_kernels.quant import BLOCK, quantize_per_head
from openvc_kernels.repair import attention_mass, residual_energy, select_repair_tokens, v_residual
from openvc_kernels.sm90.layout import CHUNK, KEY_PERMUTATION

cutlass = pytest.importorskip("cutlass")

from openvc_kernels import prep_ops  # noqa: E402  (needs cutlass)
from openvc_kernels.sm90 import prep, select  # noqa: E402

KINDS = prep_ops.PREP_KINDS
DTYPES = (torch.bfloat16, torch.float16)
POISON = 0x7F
"""E4M3 NaN: any output byte a kernel forgets to write shows up."""


def _layout_value(shape, stride, index: int) -> int:
    """Evaluate a (nested) CuTe layout at a 1-D index (colexicographic), in plain Python."""
    if isinstance(shape, int):
        return (index % shape) * stride
    total = 0
    for s, d in zip(shape, stride):
        size = _size(s)
        total += _layout_value(s, d, index % size)
        index //= size
    return total


def _size(shape) -> int:
    return shape if isinstance(shape, int) else int(torch.tensor([_size(s) for s in shape]).prod())


def test_permutation_layout_is_chunk_key():
    keys = [_layout_value(prep.PERMUTATION_SHAPE, prep.PERMUTATION_STRIDE, p) for p in range(BLOCK)]
    expected = [p // CHUNK * CHUNK + KEY_PERMUTATION[p % CHUNK] for p in range(BLOCK)]
    assert keys == expected
    # The ones rows use that each 16-position group holds the 16 keys of the same group.
    assert all(p // prep.KEYS_PER_STORE == k // prep.KEYS_PER_STORE for p, k in enumerate(keys))


_PTX_SCRIPT = """
import collections, json, re, sys, torch
from openvc_kernels import prep_ops
out = {}
for kind in prep_kinds:
    for dtype in (torch.bfloat16, torch.float16):
        ptx = prep_ops.compile_prep(kind, dtype).artifacts.PTX
        ops = collections.Counter(re.findall(r"^\\s+(?:@%p\\d+\\s+)?([a-z][a-z0-9_.:]*)", ptx, re.M))
        # Warp/CTA synchronisation inside a conditional region (between a forward `@%p bra L` and `L:`), and loops.
        open_targets, seen_labels, divergent_sync, backward = set(), set(), [], []
        for line in ptx.splitlines():
            line = line.strip()
            label = re.match(r"^(\\$L__\\w+):", line)
            if label:
                open_targets.discard(label.group(1))
                seen_labels.add(label.group(1))
                continue
            branch = re.match(r"^(@!?%p\\d+\\s+)?bra(?:\\.uni)?\\s+(\\$L__\\w+);", line)
            if branch:
                if branch.group(2) in seen_labels:
                    backward.append(line)  # a loop's back edge: it opens no region
                elif branch.group(1):
                    open_targets.add(branch.group(2))
            elif open_targets and re.match(r"^(shfl|bar|barrier|vote|match|redux|activemask)[.\\s]", line):
                divergent_sync.append(line)
        out[f"{kind}/{dtype}"] = {
            "ops": ops,
            "target": re.search(r"\\.target\\s+(\\S+)", ptx).group(1),
            "divergent_sync": divergent_sync,
            "backward_branches": backward,
        }
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def ptx_ops(tmp_path_factory) -> dict:
    """Compile every preparation kernel for sm_90a in a fresh process (no GPU needed); PTX opcode counts."""
    dump = tmp_path_factory.mktemp("prep_ptx")
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=str(dump))
    script = f"prep_kinds = {KINDS!r}\n" + _PTX_SCRIPT
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_compiles_for_sm90a(ptx_ops, kind, dtype):
    compiled = ptx_ops[f"{kind}/{dtype}"]
    ops = compiled["ops"]
    assert compiled["target"] == "sm_90a"
    count = lambda prefix: sum(n for op, n in ops.items() if op.startswith(prefix))
    assert count("ld.local") == 0 and count("st.local") == 0, "registers spilled"
    if kind == "select_repair_tokens":
        _check_select_ptx(compiled, count)
        return
    # No shfl.sync / bar.sync under a divergent branch: make_warp_uniform (warp_idx) inside `if lane == 0`
    # put a full-mask shfl.sync there, which deadlocks against bar.sync 0 (the H200 hang, notes/prep.md).
    assert compiled["divergent_sync"] == [], compiled["divergent_sync"]
    # Straight-line kernels: no loops, so a launch always terminates once every thread reaches bar.sync 0.
    assert compiled["backward_branches"] == [], compiled["backward_branches"]
    if kind == "repair_rows":
        # A thread's 8 channels of one repair key: each residual one product rounded alone and one IEEE division,
        # as torch's kernels round them, then two values per RNE-saturating conversion.
        assert ops.get("mul.rn.f32") == prep.REPAIR_CHANNELS and ops.get("div.rn.f32") == prep.REPAIR_CHANNELS
        assert count("rcp") == 0 and count("div.approx") == 0 and count("div.full") == 0
        assert ops.get("cvt.rn.satfinite.e4m3x2.f32") == prep.REPAIR_CHANNELS // 2
        return
    # The block is read once, with 16-byte loads: 8 per thread (and 4 for the 16 channel means K smoothing subtracts).
    assert ops.get("ld.global.v4.b32") == 8 + 4 * (kind == "quantize_centered_per_block")
    if kind == "absmax_per_head":
        assert count("atom.global.max") == 1
        return
    # Exact scales: two IEEE divisions (448 / a and a / 448), never the approximate ones.
    assert count("div.rn.f32") == 2 and count("rcp") == 0
    assert count("rcp.approx") == 0 and count("div.approx") == 0 and count("div.full") == 0
    # 64 values per thread, two per RNE-saturating conversion.
    assert ops.get("cvt.rn.satfinite.e4m3x2.f32") == 32
    if kind.startswith("quantize"):
        assert ops.get("st.global.v4.b32") == 4
        return
    # 16-byte stores into shared memory, byte reads through the key permutation, 16-byte packed rows
    # (4 value vectors + 1 ones-row vector per thread).
    assert ops.get("st.shared.v4.b32") == 4 and ops.get("ld.shared.b8") == 64
    assert ops.get("st.global.v4.b32") == 5
    if kind == "pack_v_energy":
        # The residual from the FP8 bytes just written, then one energy per token: a 3-step butterfly over its
        # 8 lanes for each of the 4 tokens, and one 4-byte store per token (plus d_v's).
        assert ops.get("cvt.rn.f16x2.e4m3x2") == 32 and ops.get("mul.rn.f32") == 64  # d_v * V8 rounded alone
        assert ops.get("shfl.sync.bfly.b32") == 12 and ops.get("st.global.b32") == 4 + 1


def _check_select_ptx(compiled: dict, count) -> None:
    """SelectRepairTokens (``sm90.select``): loops over the row, block barriers only where every thread is, one
    shared histogram atomic per radix pass, and int64 token stores."""
    ops = compiled["ops"]
    # One barrier after zeroing the histograms, one per radix pass, one before the warps' counts are read; none
    # inside a conditional region (a thread skipping it would hang the block).
    assert ops.get("bar.sync") == 2 + select.PASSES
    # Inside regions: only the warp-synchronous ops of the loops, whose trip count is the same on every lane of a
    # warp (match for the warp-aggregated histogram adds, ballots in the compaction); the digit search's
    # shuffles and reductions run outside any branch.
    assert {line.split()[0] for line in compiled["divergent_sync"]} <= {"match.any.sync.b32", "vote.sync.ballot.b32"}
    # Per pass and token in flight: one match and one shared atomic (by the lowest lane of each digit's peers).
    assert ops.get("match.any.sync.b32") == select.PASSES * select.LOADS_IN_FLIGHT
    assert ops.get("atom.shared.cta.add.u32") == count("atom.shared") == select.PASSES * select.LOADS_IN_FLIGHT
    # Loads in flight: each pass of the radix select and of the compaction loads LOADS_IN_FLIGHT keys a step.
    assert ops.get("ld.global.b32") == (select.PASSES + 2) * select.LOADS_IN_FLIGHT
    assert count("atom.global") == 0 and count("red.") == 0
    assert ops.get("shfl.sync.down.b32") == 5 * select.PASSES  # the suffix sums over 32 lanes
    # Score bits read 4 bytes at a time, tokens written as int64, nothing else written to global memory.
    assert {op for op in ops if op.startswith("st.global")} == {"st.global.b64"}
    assert {op for op in ops if op.startswith("ld.global")} == {"ld.global.b32"}
    assert compiled["backward_branches"], "the row is visited in loops"


def test_select_sass_has_no_local_memory():
    """ptxas spills show only in SASS (PTX has no spill code): SelectRepairTokens runs in registers and shared
    memory, at 1024 threads per block (64 registers a thread at most)."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).parents[1] / "notes" / "sass_census.py"
    spec = importlib.util.spec_from_file_location("sass_census", script)
    census = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(census)
    try:
        counts = census.compile_one("prep_select_repair_tokens")["counts"]
    except subprocess.CalledProcessError as error:
        pytest.skip(f"SASS dump failed (needs nvdisasm: pip install nvidia-cuda-nvdisasm): {error}")
    assert counts.get("EXIT", 0) >= 1
    local = {op: n for op, n in counts.items() if op.split(".")[0] in ("LDL", "STL")}
    assert local == {}, f"local memory use: {local}"
    assert any(op.startswith("ATOMS") for op in counts), "the histograms' shared-memory atomics"


# ---- GPU: byte-identical to the PyTorch reference ----


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_hopper = pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")


_reference = prepare_reference


_empty_prepared = prep_ops.empty_prepared


def _poisoned(batch: int, seq_q: int, seq_k: int, heads: int, device, *, repair_keys: int = 0) -> Prepared:
    out = _empty_prepared(batch, seq_q, seq_k, heads, device, repair_keys=repair_keys)
    for t in out[:-1]:
        t.view(torch.uint8).fill_(POISON)
    return out


def _assert_identical(out: Prepared, ref: Prepared, context: str) -> None:
    assert out.seqlen_k == ref.seqlen_k
    for name, got, want in zip(out._fields[:-1], out[:-1], ref[:-1]):
        assert got.shape == want.shape and got.dtype == want.dtype, f"{name} {context}"
        same = got.view(torch.uint8) == want.view(torch.uint8)
        if not same.all():
            first = tuple(int(i) for i in (~same).nonzero()[0])
            raise AssertionError(
                f"{name} differs in {int((~same).sum())} bytes, first at {first}: "
                f"{got.view(torch.uint8)[first]} vs {want.view(torch.uint8)[first]} ({context})"
            )


def _inputs(kind: str, shape, dtype, device) -> torch.Tensor:
    """Random (B, S, H, 128) of one flavour: normal, heavy-tailed, or with zero blocks and a zero head."""
    x = torch.randn(shape, device=device)
    if kind == "heavy":
        x = x * torch.exp(3.0 * torch.randn(shape, device=device)).clamp(max=5e3)
    elif kind == "zeros":
        x[:, BLOCK : 2 * BLOCK] = 0.0  # a whole key block (when S > 128)
        x[:, :, -1] = 0.0  # a whole head: absmax 0 takes the 1e-12 floor
        x[:, -1, 0, :5] = -0.0
    return x.to(dtype)


SHAPES = [(b, s, h) for s, b, h in itertools.product((1, 127, 128, 129, 4096, 32760), (1, 2), (1, 12))]
CASES = [(torch.bfloat16, *shape) for shape in SHAPES] + [
    (torch.float16, b, s, h) for b, s, h in SHAPES if s in (129, 4096)
]


@pytest.fixture
def seed() -> int:
    """A new seed every run, reported on failure (here rather than in conftest: the device image has no diffusers)."""
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    return seed


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("flavour", ("normal", "heavy", "zeros"))
@pytest.mark.parametrize("dtype,batch,seq_len,heads", CASES, ids=str)
def test_prepare_matches_reference(seed, dtype, batch, seq_len, heads, flavour):
    q, k, v = (_inputs(flavour, (batch, seq_len, heads, 128), dtype, "cuda") for _ in range(3))
    out = prep_ops.prepare_into(q, k, v, _poisoned(batch, seq_len, seq_len, heads, "cuda"))
    _assert_identical(out, _reference(q, k, v), f"seed {seed}")


@pytest.mark.gpu
@needs_hopper
def test_prepare_strided_inputs(seed):
    """Views of a fused QKV projection (B, S, 3, H, 128) and a head-major tensor are read in place."""
    batch, seq_q, seq_k, heads = 2, 300, 1000, 12
    q = torch.randn(batch, heads, seq_q, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k, v = torch.randn(batch, seq_k, 3, heads, 128, device="cuda", dtype=torch.bfloat16).unbind(2)[1:]
    assert all(prep_ops._kernel_ready(x).data_ptr() == x.data_ptr() for x in (q, k, v))  # no copy
    out = prep_ops.prepare_into(q, k, v, _poisoned(batch, seq_q, seq_k, heads, "cuda"))
    _assert_identical(out, _reference(q, k, v), f"seed {seed}")


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("batch,seq_len,heads", [(1, 129, 3), (2, 4100, 12)])
def test_prepare_with_smoothed_keys(seed, batch, seq_len, heads):
    q, v = (torch.randn(batch, seq_len, heads, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    offsets = 8 * torch.randn(128, device="cuda")  # per-channel offsets, what smoothing removes
    k = (torch.randn(batch, seq_len, heads, 128, device="cuda") + offsets).to(torch.bfloat16)
    out = prep_ops.prepare_into(q, k, v, _poisoned(batch, seq_len, seq_len, heads, "cuda"), smooth_k=True)
    _assert_identical(out, _reference(q, k, v, PrepareOptions(smooth_k=True)), f"seed {seed}")


@pytest.mark.gpu
@needs_hopper
def test_prepare_in_cuda_graph(seed):
    """Captured once, replayed after the inputs change in place: the same bytes as an eager call."""
    batch, seq_len, heads = 2, 4100, 12
    q, k, v = (torch.randn(batch, seq_len, heads, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    prep_ops.prepare(q, k, v)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = prep_ops.prepare(q, k, v)
    for flavour in ("heavy", "zeros"):
        for x in (q, k, v):
            x.copy_(_inputs(flavour, x.shape, x.dtype, "cuda"))
        graph.replay()
        _assert_identical(static_out, prep_ops.prepare(q, k, v), f"replay, {flavour}, seed {seed}")
        _assert_identical(static_out, _reference(q, k, v), f"replay vs reference, {flavour}, seed {seed}")



@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("batch,seq_len,heads", [(1, 129, 3), (2, 4100, 12)])
def test_residual_energy_matches_reference(seed, batch, seq_len, heads):
    """PackV's per-token residual energies: every real token written, equal to PyTorch's up to summation order."""
    q, k, v = (_inputs("heavy", (batch, seq_len, heads, 128), torch.bfloat16, "cuda") for _ in range(3))
    energy = torch.full((batch, heads, seq_len), float("nan"), device="cuda")
    prep_ops.prepare_into(q, k, v, _poisoned(batch, seq_len, seq_len, heads, "cuda"), residual_energy=energy)
    v_heads = v.transpose(1, 2)
    v8, d_v = quantize_per_head(v_heads)
    expected = residual_energy(v_residual(v_heads, v8, d_v))
    torch.testing.assert_close(energy, expected, rtol=1e-5, atol=0, msg=lambda m: f"{m} (seed {seed})")


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("batch", [1, 2])
def test_attention_mass_from_16_bit_inputs(seed, batch):
    """The 16-bit GEMM with FP32 output (straight from K's strided view) gives the FP32 path's mass estimate."""
    q, k = (torch.randn(batch, 3000, 5, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
    got = attention_mass(q, k, 0.09)
    expected = attention_mass(q.double(), k.double(), 0.09).float()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-9, msg=lambda m: f"{m} (seed {seed})")


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch,seq_len,heads,count", [(1, 129, 1, 1), (2, 4100, 12, 41), (1, 32760, 3, 300)])
def test_repair_rows_are_the_reference_rows(seed, dtype, batch, seq_len, heads, count):
    """RepairRows given the reference's tokens writes the bytes of ``preparation.write_repair_rows``: K rows, K
    descales, key tiles, value rows and zero ones rows, and zero keys after the count, over poisoned buffers.
    Heavy-tailed V (large residuals) and a head with an inf (NaN residuals) included."""
    q, k, v = (_inputs("heavy", (batch, seq_len, heads, 128), dtype, "cuda") for _ in range(3))
    v[0, seq_len // 2, heads - 1, 3] = float("inf")
    options = PrepareOptions(repair_ratio=count / seq_len)
    ref = _reference(q, k, v, options)
    assert ref.repair_tiles == -(-count // BLOCK)
    tokens = torch.topk(torch.rand(batch, heads, seq_len, device="cuda"), count, dim=-1).indices
    write_repair_rows(ref, v, tokens)
    s_pad = ref.d_k.shape[2] * BLOCK
    out = ref._replace(k8=ref.k8.clone(), v_packed=ref.v_packed.clone(), d_k_repair=torch.empty_like(ref.d_k_repair),
                       tile_repair=torch.empty_like(ref.tile_repair))
    for t in (out.k8[:, :, s_pad:], out.v_packed[..., s_pad:], out.d_k_repair, out.tile_repair):
        t.view(torch.uint8).fill_(POISON)
    prep_ops.load_prep("repair_rows", dtype)(
        v, tokens, out.k8, out.d_k, out.v_packed, out.d_v, out.d_k_repair, out.tile_repair
    )
    _assert_identical(out, ref, f"seed {seed}")


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("ranking", ["attention", "energy"])
@pytest.mark.parametrize("smooth_k", [False, True])
def test_prepare_with_repair_keys(seed, monkeypatch, ranking, smooth_k):
    """Real keys byte-identical to the reference; repair keys too, wherever both rank the same token (their
    energies are summed in different orders, so a near tie at the cut may pick another one)."""
    batch, seq_len, heads = 2, 4100, 12
    q, k, v = (torch.randn(batch, seq_len, heads, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    v[:, torch.randperm(seq_len, device="cuda")[:20]] *= 20.0
    monkeypatch.setattr(prep_ops, "empty_prepared", _poisoned)
    options = PrepareOptions(smooth_k=smooth_k, repair_ratio=0.01, repair_ranking=ranking, softmax_scale=0.09)
    out, ref = prep_ops.prepare(q, k, v, options), _reference(q, k, v, options)

    s_pad = 33 * BLOCK
    real = out._replace(
        k8=out.k8[:, :, :s_pad], v_packed=out.v_packed[..., :s_pad], d_k_repair=ref.d_k_repair,
        tile_repair=ref.tile_repair,
    )
    ref_real = ref._replace(k8=ref.k8[:, :, :s_pad], v_packed=ref.v_packed[..., :s_pad])
    _assert_identical(real, ref_real, f"real keys, seed {seed}")
    assert out.repair_tiles == ref.repair_tiles == 1
    same_key = (out.k8[:, :, s_pad:] == ref.k8[:, :, s_pad:]).all(-1)
    same_value = (out.v_packed[..., s_pad:] == ref.v_packed[..., s_pad:]).all(2)
    same = same_key & same_value & (out.d_k_repair == ref.d_k_repair) & (out.tile_repair == ref.tile_repair)
    assert same.float().mean() >= 0.99, f"{int((~same).sum())} of {same.numel()} repair keys differ (seed {seed})"
    assert (out.v_packed[:, :, 128:, s_pad:] == 0).all(), "repair keys must stay out of the denominator"


@pytest.mark.gpu
@needs_hopper
def test_prepare_with_repair_in_cuda_graph(seed):
    batch, seq_len, heads = 1, 4100, 4
    q, k, v = (torch.randn(batch, seq_len, heads, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    options = PrepareOptions(smooth_k=True, repair_ratio=0.005, repair_ranking="attention", softmax_scale=0.09)
    prep_ops.prepare(q, k, v, options)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = prep_ops.prepare(q, k, v, options)
    for x in (q, k, v):
        x.copy_(_inputs("heavy", x.shape, x.dtype, "cuda"))
    graph.replay()
    _assert_identical(static_out, prep_ops.prepare(q, k, v, options), f"replay with repair, seed {seed}")


def _scores(kind: str, shape, device) -> torch.Tensor:
    """Random (B, H, S) fp32 scores of one flavour: continuous energies, heavy ties (a few values), or ties with
    NaN, +-inf and +-0.0 among them."""
    if kind == "energy":
        return torch.rand(shape, device=device).square_() * torch.exp(4.0 * torch.randn(shape, device=device))
    values = [0.5, 1.0, 1.0000001, 2.0] if kind == "ties" else [
        float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 3.0, -3.0, 1e-40
    ]
    values = torch.tensor(values, device=device)
    return values[torch.randint(len(values), shape, device=device)]


SELECT_LENGTHS = (1, 37, 1000, 4099, 32760, 118800)
SELECT_CASES = [
    (batch, heads, seq_len, count)
    for seq_len in SELECT_LENGTHS
    for batch, heads in ((1, 40), (2, 3))
    for count in sorted({1, max(1, round(0.005 * seq_len)), max(1, seq_len // 2)})
]


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("flavour", ("energy", "ties", "special"))
@pytest.mark.parametrize("batch,heads,seq_len,count", SELECT_CASES, ids=str)
def test_select_repair_tokens_matches_reference(seed, batch, heads, seq_len, count, flavour):
    """SelectRepairTokens writes exactly ``repair.select_repair_tokens``: the same tokens, ascending, every entry
    of the poisoned output written."""
    score = _scores(flavour, (batch, heads, seq_len), "cuda")
    tokens = torch.full((batch, heads, count), -1, dtype=torch.int64, device="cuda")
    prep_ops.load_prep("select_repair_tokens", torch.bfloat16)(score, tokens)
    expected = select_repair_tokens(score, count)
    assert torch.equal(expected, select_repair_tokens(score.cpu(), count).cuda()), f"reference (seed {seed})"
    if not torch.equal(tokens, expected):
        bad = (tokens != expected).any(-1).nonzero()[0].tolist()
        raise AssertionError(
            f"head {bad}: {tokens[bad[0], bad[1]][:8].tolist()} vs {expected[bad[0], bad[1]][:8].tolist()} "
            f"(seed {seed})"
        )
