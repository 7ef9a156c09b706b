"""Device probe: HunyuanVideo's rotary embedding in the Open-VC processors (``hunyuan.rotate_video_tokens``: one launch)
against diffusers' ``apply_rotary_emb`` on Q and K, at HunyuanVideo's 720p x 129 frames (a 33 x 90 x 160 latent,
patch 2: 118,800 video tokens, 24 heads of 128, bf16) and 544p x 129 (33 x 68 x 120: 67,320), the tables from
diffusers' own ``HunyuanVideoRotaryPosEmbed``. Calls interleaved, each timed alone by CUDA events
(``bench_attention.time_interleaved``, synchronized), medians; per layer, then per step (HunyuanVideo has 20 dual-
and 40 single-stream blocks). Checks the bits. Run on a GPU from the repository root: ``python
notes/probe_hunyuan_rope.py``.
"""

import os
import statistics
import sys

import torch
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoRotaryPosEmbed

from openvc_diffusers.gpu_state import clocks
from openvc_diffusers.processors.hunyuan import launch_rotates, rotate_video_tokens

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from bench_attention import time_interleaved  # noqa: E402

LATENTS = {"720p": (33, 90, 160), "544p": (33, 68, 120)}
HEADS, LAYERS = 24, 60
BUDGET_MS = 1500
"""Of calls per size, all three interleaved: about 30 rounds at 720p."""


def probe(size: str) -> dict:
    rope = HunyuanVideoRotaryPosEmbed(patch_size=2, patch_size_t=1, rope_dim=[16, 56, 56])
    tables = rope(torch.empty(1, 16, *LATENTS[size], device="cuda"))
    q, k = (torch.randn(1, tables[0].shape[0], HEADS, 128, device="cuda", dtype=torch.bfloat16) for _ in "qk")
    calls = {
        "diffusers' apply_rotary_emb": lambda: [apply_rotary_emb(x, tables, sequence_dim=1) for x in (q, k)],
        "rotate_video_tokens": lambda: rotate_video_tokens(q, k, tables),
        "copy of Q and K": lambda: (torch.empty_like(q).copy_(q), torch.empty_like(k).copy_(k)),
    }
    with torch.no_grad():
        launched = launch_rotates(q, *tables)
        ours, theirs = calls["rotate_video_tokens"](), calls["diffusers' apply_rotary_emb"]()
        same = all(torch.equal(a, b) for a, b in zip(ours, theirs))
        times = time_interleaved(list(calls.values()), [()], "synced", BUDGET_MS)
    return {"size": size, "tokens": q.shape[1], "launch": launched, "same": same,
            **{name: statistics.median(t) for name, t in zip(calls, times)}}  # fmt: skip


def main() -> None:
    print(f"clocks before: {clocks()}")
    rows = [probe(size) for size in LATENTS]
    print(f"clocks after: {clocks()}")
    for r in rows:
        print(f"{r['size']} ({r['tokens']} tokens x {HEADS} heads): launch {r['launch']}, diffusers' bits {r['same']}")
        print(f"  {'what':<28} | ms per layer | ms per step ({LAYERS} layers)")
        for name in list(r)[4:]:
            print(f"  {name:<28} | {r[name]:12.3f} | {r[name] * LAYERS:8.1f}")


if __name__ == "__main__":
    main()
