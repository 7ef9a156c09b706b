"""Device probe: what each of the processor's default options costs over the API call, timed interleaved.

At each shape of ``SHAPES`` the complete call with the API's defaults, with K smoothing only, with V residual
repair only and with both (the processor's defaults, ``OpenVCConfig().kernel_options``), called in turn
(``bench_attention.time_interleaved``: each round calls every setting once, alternately forward and reversed), back
to back and synchronized; then the kernel alone on inputs prepared before timing, without and with the repair
keys. Per setting: its median ms and the median over rounds of its time over the first setting's in that round.
"""

import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from bench_attention import TIMINGS, median_over, time_interleaved  # noqa: E402

from openvc_diffusers.config import OpenVCConfig  # noqa: E402
from openvc_kernels import attention, attention_prepared, prepare  # noqa: E402

SHAPES = ((32760, 12), (73397, 7))
BUDGET_MS = 6000


def report(label: str, names: list[str], times: list[list[float]]) -> None:
    for name, own in zip(names, times):
        over = median_over(own, times[0])
        print(f"  {label:12s} {name:28s} {statistics.median(own):9.3f} ms  {100 * over:+6.2f}%", flush=True)


def main():
    torch.manual_seed(0)
    repair = OpenVCConfig().kernel_options["repair_ratio"]
    settings = {
        "api": {},
        "smooth_k": {"smooth_k": True},
        f"repair {repair}": {"repair_ratio": repair},
        "defaults": OpenVCConfig().kernel_options,
    }
    for seq, heads in SHAPES:
        print(f"S={seq} H={heads} ({OpenVCConfig().kernel_options})")
        sets = [[torch.randn(1, seq, heads, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
                for _ in range(2)]
        calls = [lambda q, k, v, o=options: attention(q, k, v, **o) for options in settings.values()]
        for timing in TIMINGS:
            report(timing, list(settings), time_interleaved(calls, sets, timing, BUDGET_MS))
        out = torch.empty_like(sets[0][0])
        kernel = lambda p: attention_prepared(p, out, softmax_scale=128**-0.5)
        prepared = [[prepare(*s, repair_ratio=ratio) for s in sets] for ratio in (0.0, repair)]
        # The calls take the input set's index: each setting has its own prepared inputs.
        pairs = [lambda i, p=p: kernel(p[i]) for p in prepared]
        both = time_interleaved(pairs, [[0], [1]], "back_to_back", BUDGET_MS)
        report("kernel b2b", ["kernel", f"kernel, repair {repair}"], both)


if __name__ == "__main__":
    main()
