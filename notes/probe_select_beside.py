"""Device probe: the repair tokens' choice on the caller's stream with Q's quantization beside it (shipped,
``prep_ops.prepare``) against the choice on a stream of its own, forked and joined by two events, with Q's
quantization waiting for the launch before it (``prepare_on_a_side_stream``, as until 2026-12-04), in one process.

Both ways must give the same output bytes (checked first). Then ``openvc_kernels.attention`` with the processor's
defaults both ways and the API's call (no options) are timed interleaved call by call
(``bench_attention.time_interleaved``), back to back and synchronized, at the bench's shapes: each one's median us,
the shipped way over the side stream's and the defaults over the API (medians over rounds of the ratio within a
round). Last, each way's host time per call at a small shape (``probe_host.SMALL``), where the GPU never waits.
Run on a GPU from the repository root: ``python notes/probe_select_beside.py``.
"""

import functools
import os
import statistics
import sys
from typing import NamedTuple

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from bench_attention import median_over, time_interleaved  # noqa: E402
from probe_host import SMALL, host_us  # noqa: E402

import openvc_kernels  # noqa: E402
from openvc_diffusers.config import OpenVCConfig  # noqa: E402
from openvc_kernels import prep_ops  # noqa: E402
from openvc_kernels.preparation import repair_room  # noqa: E402
from openvc_kernels.repair import repair_count, repair_score  # noqa: E402

SHAPES = ((73397, 7), (32760, 12), (75600, 40), (118800, 24))
BUDGET_MS = 4000
DTYPE = torch.bfloat16
DEFAULTS = OpenVCConfig().kernel_options


class SideStream(NamedTuple):
    """The old way's side stream, its two events, and the caller's stream (the probe runs on the default one)."""

    stream: torch.cuda.Stream
    fork: torch.cuda.Event
    join: torch.cuda.Event
    here: torch.cuda.Stream


@functools.cache
def side_stream() -> SideStream:
    """Made once, as ``prep_ops`` made them (host time)."""
    stream, here = torch.cuda.Stream(priority=-1), torch.cuda.current_stream()
    return SideStream(stream, torch.cuda.Event(), torch.cuda.Event(), here)


def prepare_on_a_side_stream(q, k, v, options, *, v_absmax=None, k_mean=None):
    """``prep_ops.prepare`` as it was: the choice on a high-priority stream of its own (``side_stream``), K's mean,
    then Q's quantization (the build that waits for the launch before it) and K's; the repair keys after the choice
    is joined back."""
    aside = side_stream()
    here = aside.here
    batch, seq_q, heads, _ = q.shape
    seq_k = k.shape[1]
    count = repair_count(seq_k, options.repair_ratio)
    kernels = prep_ops.load_kernels(q.dtype, smooth_k=options.smooth_k, energy=count > 0)
    ready_q, ready_k, ready_v = prep_ops.kernel_ready(q), prep_ops.kernel_ready(k), prep_ops.kernel_ready(v)
    k_for_sums = ready_k if options.smooth_k and k_mean is None else None
    amax_v, k_sums = prep_ops._launch_absmax(kernels, ready_v, k_for_sums, v_absmax)
    out = prep_ops.empty_prepared(batch, seq_q, seq_k, heads, q.device, repair_keys=repair_room(count))
    energy = torch.empty(batch, heads, seq_k, dtype=torch.float32, device=q.device) if count else None
    prep_ops._launch_pack(kernels, ready_v, amax_v, out, energy)
    if count:
        score = repair_score(
            energy, ready_q, ready_k, ranking=options.repair_ranking, softmax_scale=options.softmax_scale
        ).contiguous()
        tokens = torch.empty(batch, heads, count, dtype=torch.int64, device=q.device)
        aside.fork.record(here)
        aside.stream.wait_event(aside.fork)
        torch.cuda.set_stream(aside.stream)
        try:
            prep_ops.load_prep(prep_ops.select_kind(score.shape[-1]))(score, tokens)
        finally:
            torch.cuda.set_stream(here)
    mean_k = prep_ops.smoothing_mean(ready_k, k_mean, k_sums) if options.smooth_k else None
    prep_ops.load_prep("quantize_per_block", q.dtype)(ready_q, out.q8, out.d_q, None)
    prep_ops._launch_k(kernels, ready_k, out, mean_k, options.softmax_scale)
    if count:
        aside.join.record(aside.stream)
        here.wait_event(aside.join)
        prep_ops.load_prep("repair_rows", v.dtype)(
            ready_v, amax_v, tokens, out.k8, out.d_k, out.v_packed, out.d_v, out.d_k_repair, out.tile_repair
        )
    return out


SHIPPED = prep_ops.prepare
WAYS = {"beside": SHIPPED, "side stream": prepare_on_a_side_stream}


def call(q, k, v, way, options):
    prep_ops.prepare = WAYS[way]
    return openvc_kernels.attention(q, k, v, **options)


def main() -> None:
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    torch.manual_seed(0)
    for seq, heads in SHAPES:
        q, k, v = (torch.randn(1, seq, heads, 128, device="cuda", dtype=DTYPE) for _ in range(3))
        outputs = [call(q, k, v, way, DEFAULTS).view(torch.int16) for way in WAYS]
        same = torch.equal(*outputs)
        fns = [
            lambda i: call(q, k, v, "beside", {}),
            lambda i: call(q, k, v, "beside", DEFAULTS),
            lambda i: call(q, k, v, "side stream", DEFAULTS),
        ]
        for timing in ("back_to_back", "synced"):
            api, beside, aside = time_interleaved(fns, [[0], [1]], timing, BUDGET_MS)
            us = lambda t: 1e3 * statistics.median(t)
            print(
                f"S={seq} H={heads} {timing:12s} same output {same}: api {us(api):8.1f} us, defaults beside "
                f"{us(beside):8.1f}, on a side stream {us(aside):8.1f}; beside over side stream "
                f"{100 * median_over(beside, aside):+6.2f}%; defaults over api: beside "
                f"{100 * median_over(beside, api):+6.2f}%, side stream {100 * median_over(aside, api):+6.2f}%",
                flush=True,
            )
    seq, heads = SMALL
    q, k, v = (torch.randn(1, seq, heads, 128, device="cuda", dtype=DTYPE) for _ in range(3))
    for way in WAYS:
        print(f"host us per call, S={seq} H={heads}, defaults, {way}: "
              f"{host_us(lambda w=way: call(q, k, v, w, DEFAULTS)):.1f}", flush=True)
    prep_ops.prepare = SHIPPED


if __name__ == "__main__":
    main()
