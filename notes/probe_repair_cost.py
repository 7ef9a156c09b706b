"""Device probe: what the processor's defaults (K smoothing, V residual repair) cost over the API call, kernel and
complete call, in one process with the settings interleaved in shuffled rounds (the clock drifts under the cap).

Kernel only (``attention_prepared`` on inputs prepared once): without repair, with the default rho and with 4x it
(the slope per repair tile), each with and without the tail split. Complete calls: the API's defaults, smoothing
alone, repair alone, the processor's defaults. Each setting's time is the median over rounds of the median of
CALLS back-to-back calls (CUDA events between them); SM clocks are read after each round.
"""

import random
import statistics

import torch

from openvc_diffusers.config import OpenVCConfig
from openvc_diffusers.gpu_state import clocks
from openvc_kernels import attention
from openvc_kernels.ops import attention_prepared, prepare

SHAPES = ((32760, 12), (73397, 7), (75600, 40), (118800, 24))
ROUNDS, CALLS = 5, 5
RHO = OpenVCConfig().repair_ratio
SCALE = 128**-0.5


def back_to_back_ms(fn) -> float:
    events = [torch.cuda.Event(enable_timing=True) for _ in range(CALLS + 1)]
    events[0].record()
    for e in events[1:]:
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in zip(events, events[1:]))


def probe_shape(seq: int, heads: int) -> None:
    q, k, v = (torch.randn(1, seq, heads, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = torch.empty_like(q)
    prepared = {
        "none": prepare(q, k, v),
        "rho": prepare(q, k, v, smooth_k=True, repair_ratio=RHO),
        "4 rho": prepare(q, k, v, smooth_k=True, repair_ratio=4 * RHO),
    }
    settings = {}
    for name, p in prepared.items():
        for split in (True, False):
            label = f"kernel, repair {name:5s} ({p.repair_tiles} tiles), split {split!s:5s}"
            settings[label] = lambda p=p, split=split: attention_prepared(p, out, softmax_scale=SCALE, split_tail=split)
    calls = {
        "call, API": {},
        "call, smooth_k": dict(smooth_k=True),
        "call, repair": dict(repair_ratio=RHO),
        "call, processor defaults": OpenVCConfig().kernel_options,
    }
    for label, options in calls.items():
        settings[label] = lambda options=options: attention(q, k, v, **options)
    for fn in settings.values():
        fn()
    times = {label: [] for label in settings}
    seen = []
    for _ in range(ROUNDS):
        for label in random.sample(list(settings), len(settings)):
            times[label].append(back_to_back_ms(settings[label]))
        seen.append(clocks())
    flop = 4 * seq * seq * heads * 128
    base = {"kernel": None, "call": None}
    print(f"{seq}x{heads}: clocks after each round: {' / '.join(seen)}")
    for label in settings:
        ms = statistics.median(times[label])
        kind = label.split(",")[0]
        base[kind] = base[kind] or ms
        print(f"  {label:52s} {ms:9.3f} ms {flop / ms / 1e9:6.0f} TFLOP/s {100 * (ms / base[kind] - 1):+6.2f}%")


def main():
    random.seed(0)
    print(torch.cuda.get_device_name())
    for seq, heads in SHAPES:
        probe_shape(seq, heads)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
