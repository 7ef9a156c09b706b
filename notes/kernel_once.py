"""Device probe for ncu: the forward kernel on prepared inputs, twice, at S x H (default Wan2.1-1.3B 480p's
32,760 x 12; another as ``python3 notes/kernel_once.py 75600x40``).

    ncu --clock-control none -k regex:ExpCastAttentionSm90 --launch-skip 1 --launch-count 1 \
        --section SpeedOfLight python3 notes/kernel_once.py

The first launch compiles and warms up; profile the second.
"""

import sys

import torch

from openvc_kernels.ops import attention_prepared, prepare

SEQ, HEADS = (int(n) for n in (sys.argv[1] if len(sys.argv) > 1 else "32760x12").split("x"))

q, k, v = (torch.randn(1, SEQ, HEADS, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
prepared = prepare(q, k, v)
out = torch.empty_like(q)
for _ in range(2):
    attention_prepared(prepared, out, softmax_scale=128**-0.5)
torch.cuda.synchronize()
print("ran", out.float().norm().item())
