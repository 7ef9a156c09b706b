"""The device probes in notes/ still build: every variant of the probes that compile their own kernels compiles for
sm_90a here (no GPU), one subprocess per probe (the DSL reads its settings at import)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("cutlass")

NOTES = Path(__file__).parents[1] / "notes"


@pytest.mark.parametrize(
    "probe",
    ["probe_stages", "probe_encode", "probe_repair_tiles", "probe_prep_occupancy", "probe_code_check", "probe_anchor",
     "probe_promote", "probe_pack_stores", "probe_epilogue"],
)
def test_every_variant_compiles(probe):
    script = f"import {probe} as p\nfor name in p.VARIANTS:\n    print(name, flush=True)\n    p.compile_variant(name)"
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a")
    done = subprocess.run([sys.executable, "-c", script], cwd=NOTES, env=env, capture_output=True, text=True)
    assert done.returncode == 0, f"variant {done.stdout.splitlines()[-1:]} failed:\n{done.stderr[-4000:]}"
