"""Prints, as JSON, the tv layouts of the sm90 kernel's QK accumulator ("c") and PV A operand ("a"):
for each of a warpgroup's 128 lanes, the flat (m + 64 n) index of each value. Run in a subprocess by
test_sm90_compile (the DSL reads the arch from the environment at import)."""

import json
import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import cutlass.utils.hopper_helpers as sm90_helpers  # noqa: E402
from cutlass.cute.nvgpu import warpgroup  # noqa: E402

FP8, K_MAJOR = cutlass.Float8E4M3FN, cute.nvgpu.OperandMajorMode.K
found = {}


@cute.jit
def probe():
    qk = sm90_helpers.make_trivial_tiled_mma(FP8, FP8, K_MAJOR, K_MAJOR, cutlass.Float32, (1, 1, 1), (64, 128))
    pv = sm90_helpers.make_trivial_tiled_mma(
        FP8, FP8, K_MAJOR, K_MAJOR, cutlass.Float32, (1, 1, 1), (64, 136), warpgroup.OperandSource.RMEM
    )
    for name, tv in (("c", qk.tv_layout_C), ("a", pv.tv_layout_A)):
        found[name] = [[tv((t, v)) for v in range(cute.size(tv, mode=[1]))] for t in range(128)]


if __name__ == "__main__":
    cute.compile(probe)
    print(json.dumps(found))
