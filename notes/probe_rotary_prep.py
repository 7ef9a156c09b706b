"""Device probe: the rotary embedding inside the preparation (``openvc_kernels.attention(rotary=...)``: V's absmax
launch sums the rotated keys, one launch rotates and quantizes Q and K beside the tokens' choice) against its launch
first (``rotary.rotate_qk``, then the call on its outputs, as until 2026-12-05), in one process.

Both ways must give the same output bytes (checked first). Then, at Wan2.1-1.3B's 480p and 720p shapes (12 heads)
and one of 40 heads, timed interleaved call by call (``bench_attention.time_interleaved``), back to back and
synchronized: the complete call with the processor's defaults both ways, and the preparation alone both ways; each
one's median us and inside over first (medians over rounds of the ratio within a round). Last, the preparation
inside with each count of head groups (``prep_ops.head_groups``' choice first). Run on a GPU from the repository
root: ``python notes/probe_rotary_prep.py``.
"""

import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from bench_attention import median_over, time_interleaved  # noqa: E402

import openvc_kernels  # noqa: E402
from openvc_diffusers.config import OpenVCConfig  # noqa: E402
from openvc_kernels import prep_ops  # noqa: E402
from openvc_kernels.preparation import PrepareOptions  # noqa: E402
from openvc_kernels.rotary import rotate_qk  # noqa: E402

SHAPES = ((32760, 12), (75600, 12), (75600, 40))
GROUPS = (1, 2, 3, 4)
BUDGET_MS = 3000
DTYPE = torch.bfloat16
DEFAULTS = OpenVCConfig().kernel_options
PREPARE = PrepareOptions(DEFAULTS["smooth_k"], DEFAULTS["repair_ratio"], DEFAULTS["repair_ranking"])
CHOSEN_GROUPS = prep_ops.head_groups


def tables(seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random angles' (1, S, 1, 128) FP32 cos and sin, each pair's entries equal (diffusers' Wan RoPE)."""
    angles = torch.rand(seq, 64, dtype=torch.float64, device="cuda") * 100
    return tuple(f(angles).repeat_interleave(2, -1).float().view(1, seq, 1, 128) for f in (torch.cos, torch.sin))


def us(times: list[float]) -> float:
    return 1e3 * statistics.median(times)


def prepare_with_groups(head_groups, q, k, v, rotary):
    """``prep_ops.prepare`` rotating inside, with ``head_groups`` standing in for ``prep_ops.head_groups``."""
    prep_ops.head_groups = head_groups
    try:
        return prep_ops.prepare(q, k, v, PREPARE, rotary=rotary)
    finally:
        prep_ops.head_groups = CHOSEN_GROUPS


def compare(label: str, fns: list, names: tuple[str, str]) -> None:
    for timing in ("back_to_back", "synced"):
        first, inside = time_interleaved(fns, [[0], [1]], timing, BUDGET_MS)
        print(
            f"  {label:12s} {timing:12s}: {names[0]} {us(first):8.1f} us, {names[1]} {us(inside):8.1f} us, "
            f"{names[1]} over {names[0]} {100 * median_over(inside, first):+6.2f}%",
            flush=True,
        )


def main() -> None:
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    torch.manual_seed(0)
    for seq, heads in SHAPES:
        q, k, v = (torch.randn(1, seq, heads, 128, device="cuda", dtype=DTYPE) for _ in range(3))
        k += 3 * torch.randn(128, device="cuda", dtype=DTYPE)
        rotary = tables(seq)
        inside = openvc_kernels.attention(q, k, v, **DEFAULTS, rotary=rotary)
        first = openvc_kernels.attention(*rotate_qk(q, k, *rotary), v, **DEFAULTS)
        groups = CHOSEN_GROUPS(1, seq, heads, q.device)
        print(f"S={seq} H={heads}: same output {torch.equal(inside, first)}, head groups {groups}", flush=True)
        compare("call", [
            lambda i: openvc_kernels.attention(*rotate_qk(q, k, *rotary), v, **DEFAULTS),
            lambda i: openvc_kernels.attention(q, k, v, **DEFAULTS, rotary=rotary),
        ], ("first", "inside"))
        compare("preparation", [
            lambda i: prep_ops.prepare(*rotate_qk(q, k, *rotary), v, PREPARE),
            lambda i: prep_ops.prepare(q, k, v, PREPARE, rotary=rotary),
        ], ("first", "inside"))
        for other in GROUPS:
            if other == groups or other > heads:
                continue
            compare(f"G={other}", [
                lambda i: prepare_with_groups(CHOSEN_GROUPS, q, k, v, rotary),
                lambda i, g=other: prepare_with_groups(lambda *args: g, q, k, v, rotary),
            ], (f"G={groups}", f"G={other}"))


if __name__ == "__main__":
    main()
