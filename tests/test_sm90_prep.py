"""The sm90 preparation kernels: compile for sm_90a on any machine (CPU part), and on a Hopper GPU give
byte-identical results to the PyTorch quantization and packing (``quant``, ``layout.pack_v``, ``preparation``)."""

import collections
import itertools
import json
import math
import os
import subprocess
import sys
import threading
import types

import pytest
import torch
from helpers import POISON, PTXAS_REMARKS, poisoned_prepared, ptxas_spills
from torch.utils._python_dispatch import TorchDispatchMode

from openvc_kernels.preparation import Prepared, PrepareOptions, prepare_reference, write_repair_rows
from openvc_kernels.quant import (
    BLOCK, BLOCK_SUM_ORDER, apply_descale_guards, channel_block_sums, channel_mean, code_span_numerator, mean_tokens,
    num_blocks, quantize_per_block, quantize_per_head
)
from openvc_kernels.repair import attention_mass, repair_count, residual_energy, select_repair_tokens, v_residual
from openvc_kernels.sm90.layout import CHUNK, KEY_PERMUTATION, packed_position

cutlass = pytest.importorskip("cutlass")

from openvc_kernels import prep_ops  # noqa: E402  (needs cutlass)
from openvc_kernels.sm90 import prep, select  # noqa: E402

KINDS = prep_ops.PREP_KINDS
INPUT_KINDS = tuple(kind for kind in KINDS if kind not in prep_ops.DTYPE_FREE_KINDS)
DTYPES = (torch.bfloat16, torch.float16)
VARIANTS = [(kind, str(dtype)) for kind in INPUT_KINDS for dtype in DTYPES] + [
    (kind, None) for kind in prep_ops.DTYPE_FREE_KINDS
]
"""(kind, input dtype): every compiled preparation kernel."""
STARTS_BESIDE = ("quantize_q", "rotary_quantize_qk", "rotary_quantize_qk_centered")
"""The kernels that start beside the launch before them (``sm90.dependent_launch``)."""


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


def test_a_byte_read_of_packed_v_takes_eight_banks():
    """PackV reads ``sV8[key, channel]`` a byte at a time through the key permutation: lane l of warp w takes channel
    4 w + l // 8 + 32 i at position 16 (l % 8) + j. ``SV8_SWIZZLE`` must put the 8 key rows of such a read in 8
    different banks (one wavefront; 4 lanes share each word), leave each token's 16-byte chunks whole (the token-major
    stores), and move no byte outside the 16 KiB tile."""
    bits, base, shift = prep.SV8_SWIZZLE
    swizzle = lambda offset: offset ^ (((offset >> (base + shift)) & ((1 << bits) - 1)) << base)
    tile = BLOCK * prep.HEAD_DIM
    assert sorted(map(swizzle, range(tile))) == list(range(tile))
    assert all(swizzle(offset) % 16 == offset % 16 for offset in range(tile))
    for j in range(prep.KEYS_PER_STORE):
        for first_channel in range(0, prep.HEAD_DIM, 4):
            words = {swizzle((16 * (lane % 8) + KEY_PERMUTATION[j]) * prep.HEAD_DIM + first_channel + lane // 8) // 4
                     for lane in range(32)}
            assert len(words) == len({word % 32 for word in words}) == 8


def test_the_block_sum_order_is_the_load_layout_s():
    """``quant.BLOCK_SUM_ORDER`` (the reference's order) is how ChannelSumsPerBlock's threads hold a block:
    4 passes of 32 tokens, 8 warps of 4 token rows; its butterfly pairs rows r and r ^ 1, then the pairs."""
    assert BLOCK_SUM_ORDER == (BLOCK // prep.TOKENS_PER_PASS, prep.WARPS, prep.ROWS_PER_WARP) == (4, 8, 4)
    assert prep.ROW_BUTTERFLY_OFFSETS == (prep.THREADS_PER_TOKEN, 2 * prep.THREADS_PER_TOKEN) == (8, 16)


_PTX_SCRIPT = """
import collections, json, re, sys, torch
from openvc_kernels import prep_ops
out = {}
opcode = lambda line: re.match(r"^(?:@!?%p\\d+\\s+)?([a-z][a-z0-9_.:]*)", line)
touches_global = lambda line: re.match(r"^(@!?%p\\d+\\s+)?((ld|st|atom|red)\\.global|cp\\.async\\.bulk)", line)
for kind, dtype in prep_variants:
    compiled = prep_ops.compile_prep(kind, dtype and getattr(torch, dtype.removeprefix("torch.")))
    ptx = compiled.artifacts.PTX
    ops = collections.Counter(re.findall(r"^\\s+(?:@%p\\d+\\s+)?([a-z][a-z0-9_.:]*)", ptx, re.M))
    # Warp/CTA synchronisation inside a conditional region (between `@%p bra L` and a later `L:`), and loops
    # (a branch back to `L:`), with any synchronisation inside them and the opcodes of each loop's body.
    open_targets, seen_labels, divergent_sync, backward, sync_in_loop, loops = set(), {}, [], [], [], []
    lines = [line.strip() for line in ptx.splitlines()]
    is_sync = lambda line: re.match(r"^(shfl|bar|barrier|vote|match|redux|activemask)[.\\s]", line)
    for index, line in enumerate(lines):
        label = re.match(r"^(\\$L__\\w+):", line)
        if label:
            open_targets.discard(label.group(1))
            seen_labels[label.group(1)] = index
            continue
        branch = re.match(r"^(@!?%p\\d+\\s+)?bra(?:\\.uni)?\\s+(\\$L__\\w+);", line)
        if branch:
            if branch.group(2) in seen_labels:
                backward.append(line)
                body = lines[seen_labels[branch.group(2)] : index]
                sync_in_loop += [x for x in body if is_sync(x)]
                loops.append(collections.Counter(m.group(1) for m in map(opcode, body) if m))
            elif branch.group(1):
                open_targets.add(branch.group(2))
        elif open_targets and is_sync(line):
            divergent_sync.append(line)
    # The dynamic shared memory of the launch: the i64 constant the host code stores into field 2 of
    # cudaLaunchConfig_t {dim3 grid, dim3 block, size_t dynamicSmemBytes, stream, attrs, numAttrs} (per function:
    # SSA names are local to one).
    launch_smem = []
    host = "\\n".join(x for x in str(compiled.ir_module).splitlines() if "kernels_binary" not in x)
    for function in host.split("llvm.func ")[1:]:
        constants = dict(re.findall(r"(%\\d+) = llvm\\.mlir\\.constant\\((\\d+) : i64\\)", function))
        config = r"llvm\\.struct<\\(array<3 x i32>, array<3 x i32>, i64, ptr, ptr, i32\\)>"
        fields = re.findall(r"(%\\d+) = llvm\\.getelementptr %\\d+\\[0, 2\\] : .*" + config, function)
        for field in fields:
            launch_smem += [
                int(constants[value]) for value in re.findall(rf"llvm\\.store (%\\d+), {field} : i64", function)
                if value in constants
            ]
    # Programmatic dependent launch (sm90.dependent_launch): where griddepcontrol.wait and launch_dependents sit
    # among the global memory accesses.
    first_at = lambda op: next((i for i, line in enumerate(lines) if line.startswith(op)), len(lines))
    wait_at, lets_start_at = first_at("griddepcontrol.wait"), first_at("griddepcontrol.launch_dependents")
    out[f"{kind}/{dtype}"] = {
        "waits": wait_at < len(lines),
        "lets_next_start": lets_start_at < len(lines),
        "waits_before_letting_next_start": wait_at < lets_start_at,
        "global_before_wait": [line for line in lines[:wait_at] if touches_global(line)],
        "global_after_wait": [line for line in lines[wait_at:] if touches_global(line)],
        "global_before_letting_next_start": [line for line in lines[:lets_start_at] if touches_global(line)],
        "ops": ops,
        "loops": loops,
        "launch_smem": launch_smem,
        "target": re.search(r"\\.target\\s+(\\S+)", ptx).group(1),
        "divergent_sync": divergent_sync,
        "backward_branches": backward,
        "sync_in_loop": sync_in_loop,
        # masked_fill(math.nan)'s float32 NaN, 0x7fc00000, stored as an immediate.
        "stores_quiet_nan": bool(re.search(r"st\\.global\\.[bf]32\\s+\\[[^]]+\\],\\s*(2143289344|0f7FC00000);", ptx)),
    }
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def ptx_ops(tmp_path_factory) -> dict:
    """Compile every preparation kernel for sm_90a in a fresh process (no GPU needed); PTX opcode counts."""
    dump = tmp_path_factory.mktemp("prep_ptx")
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=str(dump), **PTXAS_REMARKS)
    script = f"prep_variants = {VARIANTS!r}\n" + _PTX_SCRIPT
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    compiled = json.loads(done.stdout.strip().splitlines()[-1])
    return {**compiled, SPILLS: ptxas_spills(done.stderr)}


SPILLS = "ptxas spills"
"""``ptx_ops``' entry with every compiled kernel's spills (``helpers.ptxas_spills``), beside the variants' PTX."""


def test_no_kernel_spills_registers(ptx_ops):
    """What the PTX's ld.local / st.local counts cannot see: ptxas's own spills, in every preparation kernel."""
    spills = ptx_ops[SPILLS]
    assert len(spills) == len(VARIANTS), [name for name, _, _ in spills]
    assert [report for report in spills if report[1:] != (0, 0)] == []


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", INPUT_KINDS)
def test_compiles_for_sm90a(ptx_ops, kind, dtype):
    compiled = ptx_ops[f"{kind}/{dtype}"]
    ops = compiled["ops"]
    assert compiled["target"] == "sm_90a"
    count = lambda prefix: sum(n for op, n in ops.items() if op.startswith(prefix))
    assert count("ld.local") == 0 and count("st.local") == 0, "registers spilled"
    # No shfl.sync / bar.sync under a divergent branch: make_warp_uniform (warp_idx) inside `if lane == 0`
    # put a full-mask shfl.sync there, which deadlocks against bar.sync 0 (the H200 hang, notes/prep.md).
    if kind.startswith("rotary_quantize_qk"):
        _check_rotary_quantize_ptx(kind, compiled)
        return
    assert compiled["divergent_sync"] == [], compiled["divergent_sync"]
    # Straight-line kernels: no loops, so a launch always terminates once every thread reaches bar.sync 0.
    assert compiled["backward_branches"] == [], compiled["backward_branches"]
    if kind == "channel_sums_per_block":
        # The block read once (8 16-byte loads a thread); per channel 3 adds over the passes, 2 over the warp's rows
        # (a butterfly), and 7 over the warps; the warps' sums through shared memory, one store per channel.
        assert ops.get("ld.global.v4.b32") == 8 and count("cvt.f32.") == 64
        channels = prep.CHANNELS_PER_THREAD
        assert ops.get("add.f32") == channels * (3 + 2) + prep.WARPS - 1
        assert ops.get("shfl.sync.bfly.b32") == 2 * channels and count("fma") == 0
        assert ops.get("st.shared.v4.b32") == channels // 4 and ops.get("ld.shared.b32") == prep.WARPS
        assert {op for op in ops if op.startswith("st.global")} == {"st.global.b32"}
        assert ops.get("bar.sync") == 1
        return
    if kind in ("absmax_and_channel_sums", "absmax_and_rotated_channel_sums"):
        # AbsmaxPerHead's and ChannelSumsPerBlock's steps in one launch: V's block and K's block read once each
        # (16 16-byte loads a thread), the sums' adds and shuffles as above, V's max by one atomic. Rotated, the
        # keys are rotated as RotaryQK rotates them (4 products rounded alone, a subtraction and an addition per
        # pair of 4 tokens x 8 pairs) and rounded to the input dtype before they are summed; the angles: cos of
        # the even channels in 16-byte loads, sin of the odd ones in 4-byte loads.
        rotated = kind == "absmax_and_rotated_channel_sums"
        pairs = 4 * 8 * rotated
        assert ops.get("ld.global.v4.b32") == 16 + 4 * pairs // 8 and ops.get("ld.global.b32", 0) == pairs
        assert ops.get("mul.rn.f32", 0) == 4 * pairs and ops.get("sub.f32", 0) == pairs and count("fma") == 0
        channels = prep.CHANNELS_PER_THREAD
        assert ops.get("add.f32") == channels * (3 + 2) + prep.WARPS - 1 + pairs and count("atom.global.max") == 1
        assert _roundings_to_16_bits(ops) == 2 * pairs
        assert ops.get("st.shared.v4.b32") == channels // 4 and ops.get("bar.sync") == 2
        assert {op for op in ops if op.startswith("st.global")} == {"st.global.b32"}
        return
    if kind == "repair_rows":
        # A thread's 8 channels of one repair key: each residual one product rounded alone and one IEEE division,
        # as torch's kernels round them (one more division: the head's scale), then two values per RNE-saturating
        # conversion, for V8 quantized again and for the residual. V and the K row read by one vector load each,
        # nothing gathered a byte at a time.
        assert ops.get("mul.rn.f32") == prep.REPAIR_CHANNELS and ops.get("div.rn.f32") == prep.REPAIR_CHANNELS + 1
        assert count("rcp") == 0 and count("div.approx") == 0 and count("div.full") == 0
        assert ops.get("cvt.rn.satfinite.e4m3x2.f32") == 2 * (prep.REPAIR_CHANNELS // 2)
        assert ops.get("ld.global.v4.b32") == 1 and ops.get("ld.global.v2.b32") == 1 and count("ld.global.b8") == 0
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


def _roundings_to_16_bits(ops: dict) -> int:
    """Values rounded from FP32 to fp16 or bf16, one or two per conversion."""
    single = sum(ops.get(f"cvt.rn.{dtype}.f32", 0) for dtype in ("f16", "bf16"))
    return single + 2 * sum(ops.get(f"cvt.rn.{dtype}x2.f32", 0) for dtype in ("f16", "bf16"))


def _check_rotary_quantize_ptx(kind: str, compiled: dict) -> None:
    """``sm90.rotary_quant.RotaryQuantizeQK``: one loop over the CTA's heads (two barriers in it, Q's absmax and
    K's, which every thread reaches: the trip count is the CTA's); per head Q's and K's blocks read with 16-byte
    loads, both before Q's barrier, rotated as RotaryQK rotates them, rounded to the input dtype, quantized as
    QuantizePerBlock quantizes them; the angles read from global memory once, before the loop, into shared
    memory, and back from it for each tensor; nothing written but the FP8 blocks and their descales."""
    ops = compiled["ops"]
    count = lambda prefix: sum(n for op, n in ops.items() if op.startswith(prefix))
    centered = kind == "rotary_quantize_qk_centered"
    pairs = 2 * 4 * 8  # Q and K, 4 tokens, 8 pairs
    values = 2 * 64
    # Synchronization only in the loop, whose trip count is the CTA's (the branch around it, taken where the CTA
    # has no head, is the only conditional region the syncs are in): per head two absmaxes, each a warp butterfly
    # and a barrier (and the warp's index, a full-warp shuffle, unless hoisted out of the loop).
    assert len(compiled["loops"]) == 1 and compiled["divergent_sync"] == compiled["sync_in_loop"]
    syncs = collections.Counter(line.split()[0] for line in compiled["sync_in_loop"])
    assert syncs["bar.sync"] == 2 and syncs["shfl.sync.bfly.b32"] == 2 * 5, syncs
    assert set(syncs) == {"bar.sync", "shfl.sync.bfly.b32", "shfl.sync.idx.b32"}, syncs
    loop = compiled["loops"][0]
    assert ops.get("ld.global.v4.b32") == 16 + 2 * 8 + 4 * centered and ops.get("ld.global.b32") == 32
    assert loop.get("ld.global.v4.b32") == 2 * 8 + 4 * centered and loop.get("ld.global.b32", 0) == 0
    assert ops.get("st.shared.b32") == 64 + 2 and ops.get("ld.shared.b32") == 2 * 64
    assert ops.get("mul.rn.f32") == 4 * pairs and count("fma") == 0 and ops.get("add.f32") == pairs
    assert ops.get("sub.f32") == pairs + 64 * centered  # K smoothing: 64 values minus their channel's mean
    assert _roundings_to_16_bits(ops) == values
    assert count("div.rn.f32") == 4 and count("rcp") == 0 and count("div.approx") == 0 and count("div.full") == 0
    assert ops.get("cvt.rn.satfinite.e4m3x2.f32") == values // 2
    assert ops.get("st.global.v4.b32") == 2 * 4 and ops.get("st.global.b32") == 2 and count("st.global") == 10


@pytest.mark.parametrize("kind,dtype", VARIANTS)
def test_a_launch_waits_for_the_one_before_it_to_touch_memory(ptx_ops, kind, dtype):
    """``sm90.dependent_launch``: every kernel of a call's chain waits for the launch before it ahead of its first
    global load or store, then lets the next start (so that a kernel that starts beside it, Q's quantization, starts
    once everything before it has completed); but Q's quantization (alone, or with K's and the rotation), which
    lets the next start before it touches memory and waits (in its last CTA) after its last global access."""
    compiled = ptx_ops[f"{kind}/{dtype}"]
    assert compiled["waits"] and compiled["lets_next_start"]
    assert compiled["global_before_letting_next_start"] == []
    if kind in STARTS_BESIDE:
        assert compiled["global_before_wait"] != [] and compiled["global_after_wait"] == []
        assert not compiled["waits_before_letting_next_start"]
    else:
        assert compiled["global_before_wait"] == [] and compiled["waits_before_letting_next_start"]


@pytest.mark.parametrize("kind", prep_ops.SELECT_KINDS)
def test_select_repair_tokens_compile_for_sm90a(ptx_ops, kind):
    """SelectRepairTokens (``sm90.select``), both variants: loops over the row, block barriers only where every
    thread is, one shared histogram atomic per radix pass, int64 token stores, and where the keys come from: the
    global row in every pass (streaming), or once, into shared memory (resident)."""
    compiled = ptx_ops[f"{kind}/None"]
    ops = compiled["ops"]
    count = lambda prefix: sum(n for op, n in ops.items() if op.startswith(prefix))
    assert compiled["target"] == "sm_90a"
    assert count("ld.local") == 0 and count("st.local") == 0, "registers spilled"
    # One barrier after zeroing the histograms (and the resident copy of the keys), one per radix pass, one before
    # the warps' counts are read; none inside a conditional region (a thread skipping it would hang the block).
    assert ops.get("bar.sync") == 2 + select.PASSES
    # Inside regions: only the warp-synchronous ops of the loops, whose trip count is the same on every lane of a
    # warp (match for the warp-aggregated histogram adds, under a branch on a warp vote, so the same on all its
    # lanes; ballots in the compaction); the digit search's shuffles and reductions run outside any branch.
    warp_ops = {"match.any.sync.b32", "vote.sync.ballot.b32", "vote.sync.any.pred"}
    assert {line.split()[0] for line in compiled["divergent_sync"]} <= warp_ops
    # Per pass and token in flight: one vote (does any lane's key take part?), then, in the warps where one does,
    # one match and one shared atomic (by the lowest lane of each digit's peers).
    assert ops.get("vote.sync.any.pred") == select.PASSES * select.LOADS_IN_FLIGHT
    assert ops.get("match.any.sync.b32") == select.PASSES * select.LOADS_IN_FLIGHT
    assert ops.get("atom.shared.cta.add.u32") == count("atom.shared") == select.PASSES * select.LOADS_IN_FLIGHT
    assert count("atom.global") == 0 and count("red.") == 0
    assert ops.get("shfl.sync.down.b32") == 5 * select.PASSES  # the suffix sums over 32 lanes
    # Score bits read 4 bytes at a time, tokens written as int64, nothing else written to global memory.
    assert {op for op in ops if op.startswith("st.global")} == {"st.global.b64"}
    assert {op for op in ops if op.startswith("ld.global")} == {"ld.global.b32"}
    # Shared memory besides the keys: the histograms (zeroed with one store a thread, 8 bins a lane read per pass
    # as two 16-byte loads) and the warps' counts (two stores, two loads).
    assert ops.get("ld.shared.v4.b32") == count("ld.shared.v") == 2 * select.PASSES
    assert count("st.shared.v") == 0
    scalar_shared_loads = count("ld.shared") - count("ld.shared.v")
    passes = select.PASSES + 2  # the row's keys are read by four radix passes and two compaction passes
    assert compiled["backward_branches"], "the row is visited in loops"
    loads_of = lambda loop, prefix: sum(n for op, n in loop.items() if op.startswith(prefix))
    global_loops = [loop for loop in compiled["loops"] if loads_of(loop, "ld.global")]
    shared_loops = [loop for loop in compiled["loops"] if loads_of(loop, "ld.shared")]
    if kind == "select_repair_tokens":
        # Streaming: each of the six passes loads LOADS_IN_FLIGHT keys a step from the global row.
        assert ops.get("ld.global.b32") == passes * select.LOADS_IN_FLIGHT
        assert [loads_of(loop, "ld.global") for loop in global_loops] == [select.LOADS_IN_FLIGHT] * passes
        assert shared_loops == [] and scalar_shared_loads == 2 and ops.get("st.shared.b32") == 3
        assert compiled["launch_smem"] == [select.SMEM_BYTES]
        return
    # Resident: the row is read from global memory in one loop only, LOADS_IN_FLIGHT loads a step, each key
    # stored to shared memory; the six passes read the keys there, LOADS_IN_FLIGHT a step and nothing from global
    # memory (a load may be narrower: the first pass needs only a key's top byte).
    assert ops.get("ld.global.b32") == select.LOADS_IN_FLIGHT
    (copy,) = global_loops
    assert loads_of(copy, "ld.global") == copy.get("st.shared.b32") == select.LOADS_IN_FLIGHT
    assert loads_of(copy, "ld.shared") == 0 and loads_of(copy, "atom") == 0 and loads_of(copy, "bar") == 0
    assert ops.get("st.shared.b32") == 3 + select.LOADS_IN_FLIGHT
    assert scalar_shared_loads == passes * select.LOADS_IN_FLIGHT + 2
    assert [loads_of(loop, "ld.shared") for loop in shared_loops] == [select.LOADS_IN_FLIGHT] * passes
    assert {op for op in ops if op.startswith("ld.shared")} <= {
        "ld.shared.b8", "ld.shared.u8", "ld.shared.b16", "ld.shared.u16", "ld.shared.b32", "ld.shared.v4.b32"
    }
    # The launch asks for the shared memory sized for RESIDENT_MAX_TOKENS keys (the compiled host code's
    # cudaLaunchConfig_t), and it fits a Hopper block.
    assert compiled["launch_smem"] == [select.RESIDENT_SMEM_BYTES] == [200_960]


def test_select_resident_shared_memory_budget():
    """The resident variant's keys, histograms and counts fit Hopper's 227 KB per block (1 KB of it static) with
    16 KB to spare; the streaming variant's 4,352 bytes."""
    assert select.SMEM_BYTES == 4 * select.PASSES * select.BINS + 2 * 4 * select.WARPS == 4352
    assert select.RESIDENT_SMEM_BYTES == select.SMEM_BYTES + 4 * select.RESIDENT_MAX_TOKENS == 200_960
    assert select.SMEM_LIMIT_BYTES == 227 * 1024 and select.STATIC_SMEM_BYTES == 1024
    assert select.SMEM_LIMIT_BYTES - select.STATIC_SMEM_BYTES - select.RESIDENT_SMEM_BYTES >= 16 * 1024
    assert select.RESIDENT_MAX_TOKENS >= 32_760, "Wan 480p's S"


class _RecordedCall(TorchDispatchMode):
    """What one ``prep_ops`` call on CPU tensors sends to its stream, in order, with every compiled kernel replaced
    by a recorder (``record_launches``): ``("launch", kind, args)`` for a kernel, ``("alloc", data_ptr)`` for a new
    buffer, ``("op", name)`` for a torch op that would run a GPU kernel; views run none and are left out."""

    ALLOCATIONS = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default}
    NO_KERNEL = {torch.ops.aten._unsafe_view.default}

    def __init__(self, monkeypatch):
        super().__init__()
        self.events = []
        launch = lambda kind: lambda *args: self.events.append(("launch", kind, args))  # noqa: E731
        monkeypatch.setattr(prep_ops, "load_prep", lambda kind, dtype=None: launch(kind))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.ALLOCATIONS:
            self.events.append(("alloc", out.data_ptr()))
        elif not func.is_view and func not in self.NO_KERNEL:
            self.events.append(("op", str(func)))
        return out

    def kinds(self) -> list[str]:
        return [event[1] for event in self.events if event[0] == "launch"]


def test_prepare_picks_the_select_variant_by_sequence_length(monkeypatch):
    """Resident up to RESIDENT_MAX_TOKENS (its keys fit shared memory), streaming above; ``prepare`` launches
    ``select_kind`` of the score row's length, once, and ``build_failure`` loads both variants."""
    from openvc_kernels import ops

    limit = select.RESIDENT_MAX_TOKENS
    for seq_len in (1, 37, 32_760, limit - 1, limit):
        assert prep_ops.select_kind(seq_len) == "select_repair_tokens_resident", seq_len
    for seq_len in (limit + 1, 73_397, 75_600, 118_800):
        assert prep_ops.select_kind(seq_len) == "select_repair_tokens", seq_len
    assert prep_ops.SELECT_KINDS == ("select_repair_tokens", "select_repair_tokens_resident")
    assert set(prep_ops.SELECT_KINDS) <= set(prep_ops.DTYPE_FREE_KINDS) <= set(prep_ops.PREP_KINDS)
    for seq_len in (limit, limit + 1):
        q, k, v = (torch.randn(1, seq_len, 1, 128, dtype=torch.bfloat16) for _ in range(3))
        with _RecordedCall(monkeypatch) as call:
            prep_ops.prepare(q, k, v, PrepareOptions(repair_ratio=0.005, repair_ranking="energy"))
        assert [kind for kind in call.kinds() if kind in prep_ops.SELECT_KINDS] == [prep_ops.select_kind(seq_len)]
    loaded = []
    monkeypatch.setattr(prep_ops, "load_kernels", lambda *args, **kwargs: None)
    monkeypatch.setattr(prep_ops, "load_prep", lambda kind, dtype=None: loaded.append((kind, dtype)))
    monkeypatch.setattr(ops, "_kernel", lambda config: None)
    ops.build_failure.cache_clear()
    try:
        assert ops.build_failure(torch.bfloat16, plain_order=False, smooth_k=False, repair=True) is None
    finally:
        ops.build_failure.cache_clear()
    assert loaded == [(kind, None) for kind in prep_ops.SELECT_KINDS] + [("repair_rows", torch.bfloat16)]


PREPARE_CALLS = {
    "API": dict(options=PrepareOptions()),
    "smooth_k": dict(options=PrepareOptions(smooth_k=True)),
    "defaults": dict(options=PrepareOptions(smooth_k=True, repair_ratio=0.005)),
    "repair, attention ranking": dict(options=PrepareOptions(repair_ratio=0.01, repair_ranking="attention")),
    "smooth_k, both given": dict(options=PrepareOptions(smooth_k=True, repair_ratio=0.005), given=True),
    "into": dict(into=True),
    "into, smooth_k and energies": dict(into=True, smooth_k=True, energy=True),
    "into, smooth_k, both given": dict(into=True, smooth_k=True, given=True),
    "rotary": dict(options=PrepareOptions(), rotary=True),
    "rotary, smooth_k": dict(options=PrepareOptions(smooth_k=True), rotary=True),
    "rotary, defaults": dict(options=PrepareOptions(smooth_k=True, repair_ratio=0.005), rotary=True),
}


@pytest.mark.parametrize("case", PREPARE_CALLS)
def test_q_quantization_starts_beside_a_chained_launch_into_buffers_made_before_it(monkeypatch, case):
    """``quantize_q`` (with a rotary embedding: ``rotary_quantize_qk``, Q's and K's quantization) does not wait for
    the launch before it (``sm90.dependent_launch``), so ``prepare`` and ``prepare_into`` must launch it right after
    one of the preparation's kernels (which waited for everything before it: never after a torch op, nor first),
    and into buffers allocated before that launch (none the kernel before it may still be using); K's mean, which
    the rotated launch reads, comes from a launch before that one. Kernels replaced by recorders, on CPU tensors:
    the order the calls send to the stream."""
    spec = PREPARE_CALLS[case]
    batch, seq_len, heads = 2, 300, 3
    q, k, v = (torch.randn(batch, seq_len, heads, 128, dtype=torch.bfloat16) for _ in range(3))
    given, rotary = {}, None
    if "given" in spec:
        given = dict(v_absmax=torch.rand(batch, heads) + 1, k_mean=torch.randn(batch, heads, 128))
    if "rotary" in spec:
        rotary = tuple(torch.randn(1, seq_len, 1, 128) for _ in range(2))
        monkeypatch.setattr(prep_ops, "head_groups", lambda *args: 1)
    with _RecordedCall(monkeypatch) as call:
        if "into" in spec:
            out = prep_ops.empty_prepared(batch, seq_len, seq_len, heads, q.device)
            energy = torch.empty(batch, heads, seq_len) if "energy" in spec else None
            start = len(call.events)
            prep_ops.prepare_into(q, k, v, out, smooth_k="smooth_k" in spec, residual_energy=energy, **given)
        else:
            start = 0
            prep_ops.prepare(q, k, v, spec["options"], **given, rotary=rotary)
    events = call.events[start:]
    at = [i for i, event in enumerate(events) if event[0] == "launch" and event[1] in STARTS_BESIDE]
    assert len(at) == 1, call.kinds()
    work_before = [i for i, event in enumerate(events[:at[0]]) if event[0] != "alloc"]
    assert work_before, "quantize_q launched first in the call"
    before = events[work_before[-1]]
    assert before[0] == "launch" and before[1] not in STARTS_BESIDE, (case, events[: at[0] + 1])
    made_after = {event[1] for event in events[work_before[-1]:at[0]] if event[0] == "alloc"}
    if rotary is None:
        _, _, (x, q8, d_q, mean) = events[at[0]]
        assert x.data_ptr() == q.data_ptr() and mean is None
        assert not made_after & {q8.data_ptr(), d_q.data_ptr()}, case
        return
    _, kind, (x_q, x_k, cos, sin, q8, d_q, k8, d_k, mean, groups) = events[at[0]]
    smooth_k = spec["options"].smooth_k
    assert kind == prep_ops.rotary_quantize_kind(smooth_k) and (x_q.data_ptr(), x_k.data_ptr()) == (
        q.data_ptr(), k.data_ptr()
    )
    assert cos.shape == sin.shape == (seq_len, 128) and groups == 1
    assert not made_after & {t.data_ptr() for t in (q8, d_q, k8, d_k)}, case
    kinds = [event[1] for event in events[: work_before[-1]] if event[0] == "launch"]
    assert kinds[0] == ("absmax_and_rotated_channel_sums" if smooth_k else "absmax_per_head")
    assert (mean is not None) == smooth_k and ("channel_mean" in kinds) == smooth_k


def test_head_groups_give_every_sm_three_ctas_at_the_fewest_angle_reads(monkeypatch):
    """``prep_ops.head_groups``: one group (each block's angles read once) wherever the blocks alone give each of
    the GPU's 132 SMs ``ROTARY_CTAS_PER_SM`` (3) CTAs, as at Wan's 720p; otherwise the fewest groups that do, at
    most one per head."""
    device = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(multi_processor_count=132))
    groups = prep_ops.head_groups.__wrapped__
    assert prep_ops.ROTARY_CTAS_PER_SM == 3
    assert groups(1, 75_600, 12, device) == groups(1, 50_688, 40, device) == 1  # 591 and 396 blocks
    assert groups(1, 32_760, 12, device) == 2  # Wan 480p: 256 blocks, 512 CTAs
    assert groups(1, 50_560, 40, device) == 2  # 395 blocks: one short of 396
    assert groups(2, 16_900, 40, device) == 2  # 2 x 133 blocks
    assert groups(1, 4096, 12, device) == 12 and groups(1, 4096, 40, device) == 13  # 32 blocks: 396 CTAs need 13
    assert groups(2, 1000, 3, device) == 3 and groups(1, 128, 2, device) == 2  # fewer heads than SMs need


@pytest.mark.parametrize("given", ["attention ranking", "v_absmax", "k_mean"])
def test_prepare_refuses_to_rotate_inside_where_rotated_q_and_k_are_needed(monkeypatch, given):
    """The "attention" ranking and shared scales read q and k (rotated, they would have to be): ``prepare`` with
    tables raises before any launch instead of reading them unrotated."""
    batch, seq_len, heads = 1, 300, 2
    q, k, v = (torch.randn(batch, seq_len, heads, 128, dtype=torch.bfloat16) for _ in range(3))
    rotary = tuple(torch.randn(1, seq_len, 1, 128) for _ in range(2))
    ranking = "attention" if given == "attention ranking" else "energy"
    options = PrepareOptions(smooth_k=True, repair_ratio=0.01, repair_ranking=ranking)
    scales = {
        "v_absmax": {"v_absmax": torch.ones(batch, heads)}, "k_mean": {"k_mean": torch.zeros(batch, heads, 128)}
    }.get(given, {})
    with _RecordedCall(monkeypatch) as call, pytest.raises(ValueError, match="rotate first \\(rotary.rotate_qk\\)"):
        prep_ops.prepare(q, k, v, options, rotary=rotary, **scales)
    assert call.events == []


def test_kernel_ready_reads_in_place_where_the_kernels_can():
    """Views the kernels can read come back as they are (no copy, strides kept); a size-1 dim's stride that is not
    a multiple of 8 elements becomes 0, still without a copy; a head dim that is not contiguous is copied."""
    heads = 3
    qkv = torch.randn(2, 40, 3, heads, 128, dtype=torch.bfloat16)
    k = qkv[:, :, 1]
    ready = prep_ops.kernel_ready(k)
    assert ready.data_ptr() == k.data_ptr() and ready.stride() == k.stride()
    one = torch.randn(1, 40, heads, 128, dtype=torch.bfloat16)
    odd = one.as_strided(one.shape, (5, heads * 128, 128, 1))
    ready = prep_ops.kernel_ready(odd)
    assert ready.data_ptr() == odd.data_ptr() and ready.stride() == (0, heads * 128, 128, 1)
    assert torch.equal(ready, one)
    spread = torch.randn(2, 40, heads, 256, dtype=torch.bfloat16)[..., ::2]
    ready = prep_ops.kernel_ready(spread)
    assert ready.data_ptr() != spread.data_ptr() and ready.is_contiguous() and torch.equal(ready, spread)


@pytest.mark.parametrize("kind", prep_ops.SELECT_KINDS)
def test_select_sass_has_no_local_memory(kind):
    """ptxas spills show only in SASS (PTX has no spill code): SelectRepairTokens runs in registers and shared
    memory, at 1024 threads per block (64 registers a thread at most), in both variants; the resident variant
    loads the row from global memory in one place only."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).parents[1] / "notes" / "sass_census.py"
    spec = importlib.util.spec_from_file_location("sass_census", script)
    census = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(census)
    try:
        counts = census.compile_one(f"prep_{kind}")["counts"]
    except subprocess.CalledProcessError as error:
        pytest.skip(f"SASS dump failed (needs nvdisasm: pip install nvidia-cuda-nvdisasm): {error}")
    assert counts.get("EXIT", 0) >= 1
    local = {op: n for op, n in counts.items() if op.split(".")[0] in ("LDL", "STL")}
    assert local == {}, f"local memory use: {local}"
    assert any(op.startswith("ATOMS") for op in counts), "the histograms' shared-memory atomics"
    global_loads = sum(n for op, n in counts.items() if op.split(".")[0] == "LDG")
    shared_loads = sum(n for op, n in counts.items() if op.split(".")[0] == "LDS")
    passes = select.PASSES + 2
    # Besides the keys: two 16-byte histogram loads per pass and the warps' two counts.
    if kind == "select_repair_tokens_resident":
        assert global_loads == select.LOADS_IN_FLIGHT, counts
        assert shared_loads == passes * select.LOADS_IN_FLIGHT + 2 * select.PASSES + 2, counts
    else:
        assert global_loads == passes * select.LOADS_IN_FLIGHT, counts
        assert shared_loads == 2 * select.PASSES + 2, counts


def test_channel_mean_compiles_for_sm90a(ptx_ops):
    """K's mean from the block sums (``sm90.prep.ChannelMean``): one loop over a segment's blocks, unrolled so eight
    loads are in flight, a barrier outside it, the segments added in order, one IEEE division."""
    compiled = ptx_ops["channel_mean/None"]
    ops = compiled["ops"]
    count = lambda prefix: sum(n for op, n in ops.items() if op.startswith(prefix))
    assert compiled["target"] == "sm_90a"
    assert count("ld.local") == 0 and count("st.local") == 0, "registers spilled"
    assert compiled["divergent_sync"] == [] and compiled["sync_in_loop"] == [], compiled
    assert ops.get("bar.sync") == 1 and compiled["backward_branches"]
    # Eight unrolled loads and one of the remainder; nine adds of block sums, then seven of segments.
    assert ops.get("ld.global.b32") == 8 + 1 and ops.get("add.f32") == 9 + prep.MEAN_SEGMENTS - 1
    assert ops.get("ld.shared.b32") == prep.MEAN_SEGMENTS and count("fma") == 0
    assert ops.get("div.rn.f32") == 1 and count("rcp") == 0 and count("div.approx") == 0 and count("div.full") == 0
    assert ops.get("st.global.b32") == 1


def test_descale_guards_compile_for_sm90a(ptx_ops):
    """The guards' one launch (``sm90.guards``): torch's rounding and NaN handling in the PTX, bounded loops."""
    compiled = ptx_ops["descale_guards/None"]
    ops = compiled["ops"]
    count = lambda prefix: sum(n for op, n in ops.items() if op.startswith(prefix))
    assert compiled["target"] == "sm_90a"
    assert compiled["divergent_sync"] == [] and compiled["sync_in_loop"] == [], compiled
    # Three loops over a head's blocks (d_k, d_q's reads, d_q's writes); one bar.sync between reads and writes.
    assert len(compiled["backward_branches"]) == 3 and ops.get("bar.sync") == 1
    assert count("ld.local") == 0 and count("st.local") == 0, "registers spilled"
    # The bound reciprocal(d_k_max) * numerator: one IEEE-rounded reciprocal (rcp.rn, or div.rn of 1), never an
    # approximate one, then one product rounded on its own.
    assert count("rcp.rn.f32") + count("div.rn.f32") == 1, ops
    assert count("rcp.approx") == 0 and count("div.approx") == 0 and count("div.full") == 0
    assert count("rcp.rn.ftz") == 0 and count("div.rn.ftz") == 0 and count("mul.rn.ftz") == 0
    assert ops.get("mul.rn.f32") == 1
    # torch.minimum's min.f32 (::min) with NaN selected by hand; no max.NaN/min.NaN, whose NaN is the canonical
    # one instead of the operand's bits.
    assert ops.get("min.f32") == 1 and count("min.NaN") == 0 and count("max.NaN") == 0
    # d_k, d_q, d_q again (its writes), d_v: one 4-byte load each; d_q's store and d_v's poison 0x7fc00000.
    assert ops.get("ld.global.b32") == 4 and ops.get("st.global.b32") == 2 and compiled["stores_quiet_nan"]


# ---- GPU: byte-identical to the PyTorch reference ----


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_hopper = pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")


_reference = prepare_reference


_empty_prepared = prep_ops.empty_prepared


def _poisoned(batch: int, seq_q: int, seq_k: int, heads: int, device, *, repair_keys: int = 0) -> Prepared:
    return poisoned_prepared(_empty_prepared(batch, seq_q, seq_k, heads, device, repair_keys=repair_keys))


def _assert_identical(out: Prepared, ref: Prepared, context: str) -> None:
    assert out.seqlen_k == ref.seqlen_k
    for name, got, want in zip(out._fields[:-1], out[:-1], ref[:-1]):
        _assert_same_bits(got, want, f"{name} ({context})")


INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """The same shape, dtype and bits, element by element (NaN payloads and -0.0 included)."""
    assert got.shape == want.shape and got.dtype == want.dtype, f"{what}: {got.shape} {got.dtype}"
    width = got.element_size()
    got_bits, want_bits = got.view(INT_OF_WIDTH[width]), want.view(INT_OF_WIDTH[width])
    same = got_bits == want_bits
    if not same.all():
        first = tuple(int(i) for i in (~same).nonzero()[0])
        mask, digits = (1 << 8 * width) - 1, 2 + 2 * width
        raise AssertionError(
            f"{what} differs in {int((~same).sum())} of {same.numel()} values, first at {first}: "
            f"{int(got_bits[first]) & mask:#0{digits}x} vs {int(want_bits[first]) & mask:#0{digits}x}"
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
    assert all(prep_ops.kernel_ready(x).data_ptr() == x.data_ptr() for x in (q, k, v))  # no copy
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
@pytest.mark.parametrize("given", ["neither", "v_absmax", "k_mean", "both"])
def test_prepare_with_smoothed_keys_and_given_scales(seed, given):
    """Each way K's mean and V's absmax come to the launches: both reduced here (the block sums in V's absmax
    launch), one of them given (the other's launch alone), or both given (neither launch); with and without repair
    (the tokens' choice, with Q's quantization beside it)."""
    batch, seq_len, heads = 2, 1500, 3
    q, v = (torch.randn(batch, seq_len, heads, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k = (torch.randn(batch, seq_len, heads, 128, device="cuda") + 8 * torch.randn(128, device="cuda")).to(q.dtype)
    scales = {
        "v_absmax": 1.5 * v.float().abs().amax(dim=(1, 3)) if given in ("v_absmax", "both") else None,
        "k_mean": k.float().mean(dim=1) + 0.25 if given in ("k_mean", "both") else None,
    }
    poisoned = _poisoned(batch, seq_len, seq_len, heads, "cuda")
    out = prep_ops.prepare_into(q, k, v, poisoned, smooth_k=True, **scales)
    _assert_identical(out, _reference(q, k, v, PrepareOptions(smooth_k=True), **scales), f"{given}, seed {seed}")
    options = PrepareOptions(smooth_k=True, repair_ratio=0.01)
    with_repair = prep_ops.prepare(q, k, v, options, **scales)
    expected = _reference(q, k, v, options, **scales)
    for name in ("q8", "d_q", "d_k", "d_v"):
        _assert_same_bits(getattr(with_repair, name), getattr(expected, name), f"{name}, {given}, seed {seed}")
    real_rows = num_blocks(seq_len) * BLOCK  # the repair keys after them depend on the ranking's summation order
    _assert_same_bits(with_repair.k8[:, :, :real_rows], expected.k8[:, :, :real_rows], f"k8, {given}, seed {seed}")


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "k of fused qkv", "head-major"])
@pytest.mark.parametrize("seq_len", [1, 127, 129, 1000, 4100, 32_760, 73_397])
def test_channel_mean_matches_reference(seed, dtype, layout, seq_len):
    """K's mean in two launches (``sm90.prep.ChannelSumsPerBlock``, ``ChannelMean``) into poisoned buffers: the
    bits of ``quant.channel_mean``'s block sums (of every 8th key) and mean, on the GPU and on the CPU alike, in any
    layout; the block sums the same from the launch that takes V's absmax too (``AbsmaxAndChannelSums``), and that
    absmax ``AbsmaxPerHead``'s."""
    batch, heads = 2, 3
    offsets = 40 * torch.randn(heads, 128, device="cuda")  # channel offsets: the summation order shows
    qkv = (torch.randn(batch, seq_len, 3, heads, 128, device="cuda") + offsets).to(dtype)
    k = {
        "contiguous": qkv[:, :, 1].contiguous(),
        "k of fused qkv": qkv[:, :, 1],
        "head-major": qkv[:, :, 1].transpose(1, 2).contiguous().transpose(1, 2),
    }[layout]
    sums = torch.full((batch, heads, num_blocks(seq_len), 128), math.nan, device="cuda")
    mean = torch.full((batch, heads, 128), math.nan, device="cuda")
    prep_ops.load_prep("channel_sums_per_block", dtype)(prep_ops.kernel_ready(k), sums)
    prep_ops.load_prep("channel_mean")(sums, mean, mean_tokens(seq_len))
    expected_sums = channel_block_sums(k)
    assert torch.equal(sums, expected_sums), f"{layout}, seed {seed}"
    assert torch.equal(mean, channel_mean(k)), f"{layout}, seed {seed}"
    assert torch.equal(prep_ops.channel_mean(k), mean)
    v = qkv[:, :, 2] * torch.rand(heads, 1, device="cuda").to(dtype)  # a scale of its own per head
    ready_k, ready_v = prep_ops.kernel_ready(k), prep_ops.kernel_ready(v)
    both_sums = torch.full_like(sums, math.nan)
    amax, both_amax = (torch.zeros(batch, heads, device="cuda") for _ in range(2))
    prep_ops.load_prep("absmax_per_head", dtype)(ready_v, amax)
    prep_ops.load_prep("absmax_and_channel_sums", dtype)(ready_v, ready_k, both_amax, both_sums, None, None)
    assert torch.equal(both_sums, expected_sums), f"{layout}, seed {seed}"
    assert torch.equal(both_amax, amax) and torch.equal(amax, v.float().abs().amax(dim=(1, 3))), f"seed {seed}"
    if seq_len <= 4100:
        assert torch.equal(channel_mean(k.cpu()), mean.cpu()), f"the CPU's reference, seed {seed}"


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
    amax = v.float().abs().amax(dim=(1, 3))
    prep_ops.load_prep("repair_rows", dtype)(
        v, amax, tokens, out.k8, out.d_k, out.v_packed, out.d_v, out.d_k_repair, out.tile_repair
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


@pytest.mark.gpu
@needs_hopper
def test_calls_from_two_threads_at_once_give_each_its_bytes(seed):
    """Calls with repair from two threads at once, each on a stream of its own, give each thread's bytes: every
    launch of a call goes to its caller's stream."""
    batch, seq_len, heads = 1, 4100, 4
    options = PrepareOptions(smooth_k=True, repair_ratio=0.005)
    sets = [[torch.randn(batch, seq_len, heads, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
            for _ in range(2)]
    expected = [prep_ops.prepare(*inputs, options) for inputs in sets]
    torch.cuda.synchronize()  # the threads' streams do not wait for this one
    results = [[], []]

    def run(i: int) -> None:
        with torch.cuda.stream(torch.cuda.Stream()):
            for _ in range(8):
                results[i].append(prep_ops.prepare(*sets[i], options))
            torch.cuda.current_stream().synchronize()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for i in range(2):
        assert len(results[i]) == 8
        for out in results[i]:
            _assert_identical(out, expected[i], f"thread {i}, seed {seed}")


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


SELECT_LENGTHS = (1, 37, 1000, 4099, 32760, select.RESIDENT_MAX_TOKENS, select.RESIDENT_MAX_TOKENS + 1, 118800)
"""Besides the lengths of short and Wan rows, the longest row of the resident variant and the shortest of the
streaming one alone (``prep_ops.select_kind``'s switch)."""
SELECT_CASES = [
    (batch, heads, seq_len, count)
    for seq_len in SELECT_LENGTHS
    for batch, heads in ((1, 40), (2, 3))
    for count in sorted({1, max(1, round(0.005 * seq_len)), max(1, seq_len // 2)})
]


# ---- GPU: the descale guards' launch writes the bytes of quant.apply_descale_guards ----


QUIET_NAN, NEGATIVE_NAN, SIGNALING_NAN = 0x7FC00000, -0x400000, 0x7F800001
"""float32 bit patterns: torch's NaN, the same with the sign set (0xffc00000), and a signaling NaN."""
NON_FINITE_CASES = (
    ("d_q", float("inf")), ("d_q", QUIET_NAN), ("d_q", NEGATIVE_NAN), ("d_q", SIGNALING_NAN),
    ("d_k", float("inf")), ("d_k", QUIET_NAN), ("d_k", -float("inf")), ("d_v", float("inf")), ("d_v", QUIET_NAN),
)
"""Head i of the flattened (B, H) gets case i % 14 (five of the 14 clean): one of its values replaced by this one
(an int: those float32 bits)."""


def _log_uniform(shape, low: float, high: float, device) -> torch.Tensor:
    return torch.empty(shape, device=device).uniform_(low, high).exp()


def _guard_descales(flavour: str, batch: int, heads: int, n_q: int, n_k: int, device="cuda"):
    """d_q (B, H, n_q), d_k (B, H, n_k), d_v (B, H) and a softmax scale. ``ordinary``: quantization's descales of
    absmaxes up to 22, where the code span limit never bites; ``huge``: d_q from absmaxes of 1e6 and more, where it
    bites everywhere; ``mixed``: descales over 7 decades (both), one element of a finite head forced to bite.
    Then heads get ``NON_FINITE_CASES``."""
    # Natural logs of the descales' ranges (d_q, d_k), and the softmax scale.
    q_range, k_range, scale = {
        "ordinary": ((-9, -3), (-9, -3), 128**-0.5),
        "huge": ((8, 12), (-3, 0), 1.0),
        "mixed": ((-12, 4), (-12, 4), 0.09),
    }[flavour]
    d_q = _log_uniform((batch, heads, n_q), *q_range, device)
    d_k = _log_uniform((batch, heads, n_k), *k_range, device)
    if flavour == "mixed":
        clean = len(NON_FINITE_CASES)  # the first head without a non-finite value
        d_q.view(batch * heads, -1)[clean, 0], d_k.view(batch * heads, -1)[clean, 0] = 1e4, 1.0
    d_v = _log_uniform((batch, heads), -9, -3, device)
    descales = {"d_q": d_q, "d_k": d_k, "d_v": d_v}
    for head in range(batch * heads):
        if head % 14 < len(NON_FINITE_CASES):
            name, value = NON_FINITE_CASES[head % 14]
            row = descales[name].view(batch * heads, -1)[head]
            index = int(torch.randint(row.numel(), ()))
            if isinstance(value, int):
                row.view(torch.int32)[index] = value
            else:
                row[index] = value
    return d_q, d_k, d_v, scale


def _guard_buffers(layout: str, d_q, d_k, d_v):
    """Copies of the descales in the buffers the launch gets: ``prepared``, those of ``prep_ops.empty_prepared``
    (contiguous (B, H, n)); ``offset``, contiguous views into one allocation, each starting one element after the
    previous one ends (the first 4 bytes in): base addresses aligned to 4 bytes only."""
    (batch, heads, n_q), n_k = d_q.shape, d_k.shape[2]
    if layout == "prepared":
        out = prep_ops.empty_prepared(batch, n_q * BLOCK, n_k * BLOCK, heads, "cuda")
        buffers = (out.d_q, out.d_k, out.d_v)
    else:
        flat = torch.empty(d_q.numel() + d_k.numel() + d_v.numel() + 3, device="cuda")
        offsets = [1, 1 + d_q.numel() + 1, 1 + d_q.numel() + 1 + d_k.numel() + 1]
        buffers = tuple(flat[o : o + x.numel()].view(x.shape) for o, x in zip(offsets, (d_q, d_k, d_v)))
    for buffer, x in zip(buffers, (d_q, d_k, d_v)):
        buffer.copy_(x)
    return buffers


GUARD_SIZES = (1, 3, 257, 929)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("flavour", ("energy", "ties", "special"))
@pytest.mark.parametrize("batch,heads,seq_len,count", SELECT_CASES, ids=str)
def test_select_repair_tokens_matches_reference(seed, batch, heads, seq_len, count, flavour):
    """SelectRepairTokens writes exactly ``repair.select_repair_tokens``: the same tokens, ascending, every entry
    of the poisoned output written. Both variants where the row fits shared memory (S <= RESIDENT_MAX_TOKENS),
    the streaming one everywhere."""
    score = _scores(flavour, (batch, heads, seq_len), "cuda")
    expected = select_repair_tokens(score, count)
    assert torch.equal(expected, select_repair_tokens(score.cpu(), count).cuda()), f"reference (seed {seed})"
    fits = seq_len <= select.RESIDENT_MAX_TOKENS
    kinds = [kind for kind in prep_ops.SELECT_KINDS if kind == "select_repair_tokens" or fits]
    assert len(kinds) == 1 + fits and prep_ops.select_kind(seq_len) in kinds
    for kind in kinds:
        tokens = torch.full((batch, heads, count), -1, dtype=torch.int64, device="cuda")
        prep_ops.load_prep(kind)(score, tokens)
        if not torch.equal(tokens, expected):
            bad = (tokens != expected).any(-1).nonzero()[0].tolist()
            raise AssertionError(
                f"{kind}, head {bad}: {tokens[bad[0], bad[1]][:8].tolist()} vs "
                f"{expected[bad[0], bad[1]][:8].tolist()} (seed {seed})"
            )


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("seq_len", [select.RESIDENT_MAX_TOKENS, select.RESIDENT_MAX_TOKENS + 1])
def test_prepare_selects_with_the_variant_for_its_length(seed, monkeypatch, seq_len):
    """``prepare`` with repair launches the resident variant up to RESIDENT_MAX_TOKENS keys and the streaming one
    above, once, on the whole score row, on the caller's stream; its tokens are ``repair.select_repair_tokens`` of
    that row."""
    batch, heads = 1, 3
    q, k, v = (torch.randn(batch, seq_len, heads, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    launched, load = [], prep_ops.load_prep

    def recording(kind, dtype=None):
        compiled = load(kind, dtype)
        if kind not in prep_ops.SELECT_KINDS:
            return compiled

        def run(score, tokens):
            tokens.fill_(-1)
            compiled(score, tokens)
            launched.append((kind, torch.cuda.current_stream(), score.clone(), tokens.clone()))

        return run

    monkeypatch.setattr(prep_ops, "load_prep", recording)
    caller = torch.cuda.Stream()
    caller.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(caller):
        prep_ops.prepare(q, k, v, PrepareOptions(repair_ratio=0.005, repair_ranking="energy"))
    torch.cuda.current_stream().wait_stream(caller)
    ((kind, stream, score, tokens),) = launched
    assert stream == caller
    resident = seq_len <= select.RESIDENT_MAX_TOKENS
    assert kind == ("select_repair_tokens_resident" if resident else "select_repair_tokens")
    assert score.shape == (batch, heads, seq_len) and tokens.shape[-1] == repair_count(seq_len, 0.005)
    assert torch.equal(tokens, select_repair_tokens(score, tokens.shape[-1])), f"{kind} (seed {seed})"


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("layout", ("prepared", "offset"))
@pytest.mark.parametrize("flavour", ("ordinary", "mixed", "huge"))
@pytest.mark.parametrize("n_k", GUARD_SIZES)
@pytest.mark.parametrize("n_q", GUARD_SIZES)
@pytest.mark.parametrize("batch,heads", [(1, 40), (2, 7)])
def test_descale_guards_are_apply_descale_guards(seed, batch, heads, n_q, n_k, flavour, layout):
    """In place on the descale buffers, the bits of torch's guards on CUDA: the code span limit (biting or not),
    and heads with inf or NaN (several bit patterns) in d_q, d_k or d_v; d_k untouched."""
    d_q, d_k, d_v, scale = _guard_descales(flavour, batch, heads, n_q, n_k)
    want_q, want_v = apply_descale_guards(d_q, d_k, d_v, scale, head_dim=128)
    buffers = _guard_buffers(layout, d_q, d_k, d_v)
    prep_ops.load_prep("descale_guards")(*buffers, code_span_numerator(scale, 128))
    context = f"{flavour}, {layout}, seed {seed}"
    _assert_same_bits(buffers[0], want_q, f"d_q ({context})")
    _assert_same_bits(buffers[1], d_k, f"d_k ({context})")
    _assert_same_bits(buffers[2], want_v, f"d_v ({context})")
    # The cases are there: poisoned heads, and the limit biting (or not) on the finite ones.
    poisoned = want_v.view(torch.int32) == QUIET_NAN
    assert poisoned.flatten().tolist() == [i % 14 < len(NON_FINITE_CASES) for i in range(batch * heads)]
    lowered = (want_q < d_q)[~poisoned]
    if flavour == "ordinary":
        assert not lowered.any()
    elif flavour == "huge":
        assert lowered.all()
    else:
        assert lowered.any()


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("value", [None, float("inf"), float("nan")], ids=str)
def test_prepare_with_the_code_span_limit_and_non_finite_heads(seed, value):
    """prepare_into with its guards' launch, byte-identical to the reference where the code span limit bites (huge
    queries in head 1) and, with ``value``, where a head of q, of k and of v holds an inf or a NaN."""
    batch, seq_len, heads = 2, 1000, 5
    q, k, v = (torch.randn(batch, seq_len, heads, 128, device="cuda") for _ in range(3))
    q[:, :, 1] *= 1e5
    if value is not None:
        q[1, 17, 2, 5], k[0, 900, 3, 0], v[1, 3, 4, 127] = value, value, value
    q, k, v = (x.bfloat16() for x in (q, k, v))
    out = prep_ops.prepare_into(q, k, v, _poisoned(batch, seq_len, seq_len, heads, "cuda"), softmax_scale=0.09)
    ref = _reference(q, k, v, PrepareOptions(softmax_scale=0.09))
    if value is not None and value != value:
        # PackV quantizes the padding keys of the head whose V holds the NaN with that head's NaN scale (E4M3 NaN
        # bytes; the reference pads with 0). Its output is NaN either way (d_v is poisoned); the rest must match.
        columns = packed_position(torch.arange(seq_len, BLOCK * num_blocks(seq_len), device="cuda"))
        padding = out.v_packed[1, 4, :128, columns]
        assert ((padding & 0x7F) == 0x7F).all(), "E4M3 NaN in the NaN head's padding keys"
        out.v_packed[1, 4, :128, columns] = ref.v_packed[1, 4, :128, columns]
    _assert_identical(out, ref, f"{value}, seed {seed}")
    assert (ref.d_q[:, 1] < quantize_per_block(q.transpose(1, 2))[1][:, 1]).all(), "the limit must bite in head 1"
    assert int(ref.d_v.isnan().sum()) == (0 if value is None else 3)

