"""Device probe: the attention call with its launches chained by programmatic dependent launch (shipped,
``sm90.dependent_launch``) against the same kernels launched as before, in one process.

Every preparation kernel and the forward kernel are compiled both ways (``dependent_launch.ENABLED`` read at
compile time); ``prep_ops.load_prep`` and ``ops._kernel`` are pointed at one set or the other for each call. Both
ways must give the same output bytes (checked first). Then ``openvc_kernels.attention`` with the processor's
defaults and with the API's (no options) is timed interleaved call by call (``bench_attention.time_interleaved``),
back to back and synchronized, at Wan 480p's and 14B 720p's shapes: each way's median us and the shipped way's time
over the other's (the median over rounds of the ratio within a round).
Run on a GPU from the repository root: ``python notes/probe_dependent_launch.py``.
"""

import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from bench_attention import median_over, time_interleaved  # noqa: E402

import openvc_kernels  # noqa: E402
from openvc_kernels import ops, prep_ops  # noqa: E402
from openvc_kernels.sm90 import dependent_launch  # noqa: E402
from openvc_kernels.sm90.config import ForwardConfig  # noqa: E402

SHAPES = ((32760, 12), (75600, 40))
BUDGET_MS = 3000
DTYPE = torch.bfloat16
DEFAULTS = {"smooth_k": True, "repair_ratio": 0.005}
PREP_KINDS = (
    "absmax_per_head", "absmax_and_channel_sums", "pack_v", "pack_v_energy", "channel_mean", "quantize_q",
    "quantize_per_block", "quantize_centered_per_block", "descale_guards", "select_repair_tokens_resident",
    "select_repair_tokens", "repair_rows", "absmax_and_rotated_channel_sums", "rotary_quantize_qk",
    "rotary_quantize_qk_centered",
)


def compile_all(enabled: bool) -> tuple[dict, object]:
    """Every kernel a call may launch, compiled with ``dependent_launch.ENABLED = enabled``."""
    dependent_launch.ENABLED = enabled
    try:
        prep = {}
        for kind in PREP_KINDS:
            dtype = None if kind in prep_ops.DTYPE_FREE_KINDS else DTYPE
            prep[kind, dtype] = prep_ops.compile_prep(kind, dtype)
        return prep, ops.compile_attention(ForwardConfig())
    finally:
        dependent_launch.ENABLED = True


def use(way: tuple[dict, object]) -> None:
    prep, forward = way
    prep_ops.load_prep = lambda kind, dtype=None: prep[kind, dtype]
    ops._kernel = lambda config: forward


def main() -> None:
    ways = {"dependent launch": compile_all(True), "as before": compile_all(False)}
    print("compiled both ways", flush=True)
    torch.manual_seed(0)
    for seq, heads in SHAPES:
        q, k, v = (torch.randn(1, seq, heads, 128, device="cuda", dtype=DTYPE) for _ in range(3))
        for label, options in (("defaults", DEFAULTS), ("API", {})):
            outputs = []
            for way in ways.values():
                use(way)
                outputs.append(openvc_kernels.attention(q, k, v, **options))
            same = torch.equal(outputs[0].view(torch.int16), outputs[1].view(torch.int16))

            def call(i, way, options=options):
                use(way)
                openvc_kernels.attention(q, k, v, **options)

            calls = [lambda i, w=w: call(i, w) for w in ways.values()]
            for timing in ("back_to_back", "synced"):
                shipped, before = time_interleaved(calls, [[0], [1]], timing, BUDGET_MS)
                print(
                    f"S={seq} H={heads} {label:8s} {timing:12s} same output {same}: dependent launch "
                    f"{1e3 * statistics.median(shipped):8.1f} us, as before {1e3 * statistics.median(before):8.1f} us: "
                    f"{100 * median_over(shipped, before):+6.2f}%",
                    flush=True,
                )


if __name__ == "__main__":
    main()
