"""CPU checks of the sm90 kernel: the packed-V permutation against the wgmma register layouts, pack_v,
and a compile for sm_90a whose SASS must show QGMMA and ExpCast's instruction mix (no exp per score)."""

import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers import PTXAS_REMARKS, ptxas_spills

from openvc_kernels.sm90.layout import CHUNK, E4M3_ONE, HEAD_DIM, KEY_PERMUTATION, PV_N, pack_v

cutlass = pytest.importorskip("cutlass")

SCORES_PER_THREAD = 64
"""One warpgroup's 64 x 128 score tile over 128 threads."""


def _fragment_coords() -> dict:
    """(row, column) of every (lane, value) of the QK accumulator and the PV A operand, from the DSL."""
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a")
    script = Path(__file__).with_name("sm90_fragment_coords.py")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, check=True)
    flat = json.loads(done.stdout.strip().splitlines()[-1])
    return {name: [[(i % 64, i // 64) for i in row] for row in rows] for name, rows in flat.items()}


def test_key_permutation_matches_fragments():
    """pack_codes puts C values (e, r, c) with c = 4 kb + 2 h + b // 2, e = b % 2 into A byte b of word
    (r, h) of k-block kb; A position p must then carry key chunk_key(p) of the same row."""
    coords = _fragment_coords()
    for lane in range(128):
        for value_a, (row_a, k) in enumerate(coords["a"][lane]):
            byte, r, h = value_a % 4, (value_a // 4) % 2, value_a // 8
            c = 2 * h + byte // 2
            row_c, key = coords["c"][lane][byte % 2 + 2 * r + 4 * c]
            assert row_c == row_a
            assert key == KEY_PERMUTATION[k % CHUNK] + CHUNK * (k // CHUNK)


def test_each_repair_key_comes_from_the_lane_that_loads_it():
    """softmax.load_repair_keys: lane (g, t) of a warp loads slot p's key as its own column p's key plus
    REPAIR_GROUP_KEYS g; encode_repair_keys takes column i's from lane t + 4 g', slot p' (repair_key_source(i)).
    Against the QK accumulator's layout: that key must be the one column i holds, for every lane (rows_view column
    i = e + 2 c is C value e + 4 c of row 0)."""
    from openvc_kernels.sm90.softmax import REPAIR_GROUP_KEYS, REPAIR_KEYS_PER_LANE, repair_key_source

    keys = [[key for _, key in _fragment_coords()["c"][lane]] for lane in range(128)]
    column_key = lambda lane, i: keys[lane][i % 2 + 4 * (i // 2)]
    for lane in range(128):
        for i in range(SCORES_PER_THREAD // 2):
            group, slot = repair_key_source(i)
            source = 32 * (lane // 32) + lane % 4 + 4 * group  # shfl's QUAD_SEGMENT: the reader's quad position
            loaded = column_key(source, slot) + REPAIR_GROUP_KEYS * ((source % 32) // 4)
            assert loaded == column_key(lane, i), (lane, i)
            assert slot < REPAIR_KEYS_PER_LANE


def test_pack_v_bytes():
    torch.manual_seed(0)
    seq_len = 200
    v8 = torch.randn(2, 3, seq_len, HEAD_DIM).to(torch.float8_e4m3fn)
    packed = pack_v(v8)
    assert packed.shape == (2, 3, PV_N, 256) and packed.dtype == torch.uint8
    raw = v8.view(torch.uint8)
    for position in range(256):
        key = position // CHUNK * CHUNK + KEY_PERMUTATION[position % CHUNK]
        if key < seq_len:
            assert torch.equal(packed[:, :, :HEAD_DIM, position], raw[:, :, key])
            assert (packed[:, :, HEAD_DIM:, position] == E4M3_ONE).all()
        else:
            assert (packed[:, :, :, position] == 0).all()


@pytest.fixture(scope="module", params=[False, True], ids=["default", "write_lse"])
def sass(request, tmp_path_factory) -> str:
    """The SASS of the shipped kernel, and of the one that also writes the log-sum-exp."""
    dump = tmp_path_factory.mktemp("sass")
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="sass", CUTE_DSL_DUMP_DIR=str(dump), **PTXAS_REMARKS)
    script = (
        "from openvc_kernels.ops import compile_attention; from openvc_kernels.sm90.config import ForwardConfig; "
        f"compile_attention(ForwardConfig(write_lse={request.param}))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    if done.returncode != 0 and "nvdisasm" in done.stderr:
        pytest.skip("SASS dump needs nvdisasm (pip install nvidia-cuda-nvdisasm)")
    assert done.returncode == 0, done.stderr[-4000:]
    assert [report[1:] for report in ptxas_spills(done.stderr)] == [(0, 0)], "the kernel spills registers"
    assert "wgmma" not in done.stderr.lower(), "ptxas serialized the wgmmas"
    files = sorted(Path(dump).glob("*.sass"))
    assert len(files) == 1
    return files[0].read_text()


def _opcodes(sass: str) -> Counter:
    instruction = r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9]+[.A-Z0-9]*)"
    return Counter(m.group(1) for m in re.finditer(instruction, sass))


def test_sass_has_fp8_wgmma(sass):
    """Four k-blocks of 32 per matrix product: QK^T (n128) in the first tile, the loop over real tiles and the
    repair tiles; PV (n136) in those loops, after the repair tiles and, two k-blocks only, after a half tile; the
    half tile's QK^T (n64, fwd.HALF_TILE_N)."""
    shapes = Counter(re.findall(r"QGMMA\.64x(\d+)x32\.F32\.E4M3\.E4M3", sass))
    assert shapes == {"128": 3 * 4, "136": 4 * 4 + 2, "64": 4}


def test_sass_has_no_exp_per_score(sass):
    """MUFU.EX2 per row only (the rescale, the merge of split pieces); ExpCast is one FFMA per score, one FP16
    pack (round, clip, pack) per two and one PRMT per four; no score is converted to an integer or to FP8."""
    ops = _opcodes(sass)
    count = lambda prefix: sum(n for op, n in ops.items() if op.startswith(prefix))
    assert count("MUFU.EX2") <= 4
    assert count("FFMA") >= 2 * SCORES_PER_THREAD
    # Four copies of the pack: the first key tile, the loop over real tiles and its repack where an anchor moves, the
    # repair tiles; and half of one, the half repair tile's.
    # MUFU.LG2 only in the lse variant's epilogue: two rows, in the store after the loop and after the merge.
    assert count("MUFU.LG2") <= 4
    assert count("F2FP.RELU.F16.F32") == 4 * SCORES_PER_THREAD // 2 + SCORES_PER_THREAD // 4
    assert count("PRMT") >= 3 * SCORES_PER_THREAD // 4
    assert count("F2I") + count("F2F.") + count("I2F") == 0
    assert not any("E4M3" in op for op in ops if op.startswith("F2FP")), "a score is converted to FP8"


def test_sass_checks_the_packed_codes(sass):
    """The real tiles' codes are checked on their packed halves: a tree of 31 max.u16x2 per thread (one thread's 32
    words, a subtree per row), which ptxas fuses into three-input VIMNMX3, and one vote per warp; the repair tiles' and
    the first tile's packs compute no max (their trees are dead code)."""
    ops = _opcodes(sass)
    count = lambda prefix: sum(n for op, n in ops.items() if op.startswith(prefix))
    fused, pairs = count("VIMNMX3.U16"), count("VIMNMX.U16")  # U16x2: _opcodes reads no lower case
    # ... and one a row in the rare path: the row's top code, the larger half of its packed maximum.
    assert 2 * fused + pairs == SCORES_PER_THREAD // 2 - 1 + 2, (fused, pairs)
    # The rare path's own vote: whether a code passed FP16's whole numbers (then the FP32 maxima, warp-wide).
    assert count("VOTE.ANY") == 2


def test_sass_stores_the_output_16_bytes_at_a_time(sass):
    """``epilogue.store_rows``: a thread's 64 bf16 outputs (two rows) as 8 sixteen-byte stores, after 4 shuffles per
    store (the quad's transpose), in each of the kernel's two stores (a whole unit's, a split unit's merge); no 4-byte
    output stores: those left are a piece's two anchors (``pieces.write``, whose sums go out as 8-byte pairs) and, in
    the lse variant, each store's two rows of the lse."""
    ops = _opcodes(sass)
    assert ops["STG.E.128"] == 2 * 8
    assert ops["SHFL.BFLY"] >= 2 * 8 * 4
    lse_rows = 2 * 2 if "MUFU.LG2" in ops else 0
    assert ops["STG.E"] == 2 + lse_rows
