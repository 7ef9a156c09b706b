"""notes/sass_census.py, the before/after check of a refactor: it compiles a kernel, counts its SASS and says what
changed between two censuses (no GPU)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("cutlass")

SCRIPT = Path(__file__).parents[1] / "notes" / "sass_census.py"
KERNEL = "prep_absmax_per_head_bfloat16"


def _module():
    spec = importlib.util.spec_from_file_location("sass_census", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_counts_opcodes_with_and_without_guards():
    sass = "/*0010*/  FFMA R1, R2, R3, R4 ;\n/*0020*/ @!P0 FFMA R5, R2, R3, R4 ;\n/*0030*/  EXIT ;"
    census = _module().census_of(sass)
    assert census["instructions"] == 3 and census["counts"] == {"EXIT": 1, "FFMA": 2}


def test_a_kernel_compared_with_itself_is_identical_and_a_change_is_named(tmp_path):
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    done = subprocess.run([sys.executable, str(SCRIPT), str(first), "--only", KERNEL], capture_output=True, text=True)
    if done.returncode != 0 and "nvdisasm" in done.stderr:
        pytest.skip("SASS dump needs nvdisasm (pip install nvidia-cuda-nvdisasm)")
    assert done.returncode == 0, done.stderr[-4000:]
    census = json.loads(first.read_text())
    assert list(census) == [KERNEL] and census[KERNEL]["counts"].get("EXIT", 0) >= 1
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(second), "--only", KERNEL, "--compare", str(first)],
        capture_output=True, text=True,
    )
    assert done.returncode == 0 and done.stdout.splitlines()[-1] == "identical"
    changed = json.loads(json.dumps(census))
    changed[KERNEL]["sass_hash"] = "0"
    changed[KERNEL]["counts"]["EXIT"] += 1
    assert _module().differences(census, changed) == [
        f"{KERNEL}: {census[KERNEL]['instructions']} -> {census[KERNEL]['instructions']} instructions; "
        f"EXIT {census[KERNEL]['counts']['EXIT']} -> {census[KERNEL]['counts']['EXIT'] + 1}"
    ]


def test_its_preparation_kernels_are_those_of_prep_ops():
    from openvc_kernels import prep_ops

    module = _module()
    assert module.PREP_KINDS == prep_ops.PREP_KINDS and module.DTYPE_FREE_KINDS == prep_ops.DTYPE_FREE_KINDS
    assert {"prep_descale_guards", "prep_repair_rows_float16"} <= set(module.KERNELS)
