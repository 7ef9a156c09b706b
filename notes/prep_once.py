"""Device probe for ncu: the preparation with the processor's defaults (K smoothing, V residual repair at 0.5%,
energy ranking), twice, at S x H (default Wan2.1-1.3B 480p's 32,760 x 12; another as
``python3 notes/prep_once.py 75600x40``); with ``rotary`` after the shape, rotating q and k inside (Wan's tables,
random angles: ``prep_ops.prepare(rotary=...)``), as the processor's calls do in eager inference.

    ncu --clock-control none -k regex:"PackV|QuantizePerBlock|AbsmaxAndChannelSums|SelectRepairTokens" \
        --launch-skip 5 --launch-count 5 --section SpeedOfLight python3 notes/prep_once.py

The first call compiles and warms up (five such launches); profile the second.
"""

import sys

import torch

from probe_rotary_prep import tables

from openvc_kernels import prep_ops
from openvc_kernels.preparation import PrepareOptions

SEQ, HEADS = (int(n) for n in (sys.argv[1] if len(sys.argv) > 1 else "32760x12").split("x"))
ROTARY = sys.argv[2:] == ["rotary"]
OPTIONS = PrepareOptions(smooth_k=True, repair_ratio=0.005)

q, k, v = (torch.randn(1, SEQ, HEADS, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
rotary = tables(SEQ) if ROTARY else None
for _ in range(2):
    prepared = prep_ops.prepare(q, k, v, OPTIONS, rotary=rotary)
torch.cuda.synchronize()
print("ran", prepared.d_v.sum().item())
