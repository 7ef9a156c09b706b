"""Device probe: HunyuanVideo's rotary embedding in the Open-VC processors (``hunyuan.rotate_video_tokens``: one
launch) against diffusers' ``apply_rotary_emb`` on Q and K, at HunyuanVideo's 720p x 129 frames (a 33 x 90 x 160
latent, patch 2: 118,800 video tokens, 24 heads of 128, bf16) and 544p x 129 (33 x 68 x 120: 67,320), the tables
from diffusers' own ``HunyuanVideoRotaryPosEmbed``. Calls interleaved, CUDA events around each, medians over
ROUNDS; per layer, then per step (HunyuanVideo has 20 dual- and 40 single-stream blocks). Checks the bits. Run on a
GPU from the repository root: ``python notes/probe_hunyuan_rope.py``.
"""

import statistics

import torch
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoRotaryPosEmbed

from openvc_diffusers.gpu_state import clocks
from openvc_diffusers.processors.hunyuan import launch_rotates, rotate_video_tokens

LATENTS = {"720p": (33, 90, 160), "544p": (33, 68, 120)}
HEADS, LAYERS, ROUNDS = 24, 60, 20


def timed_ms(call) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


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
        times = {name: [] for name in calls}
        for _ in range(ROUNDS):
            for name, call in calls.items():
                times[name].append(timed_ms(call))
    return {"size": size, "tokens": q.shape[1], "launch": launched, "same": same,
            **{name: statistics.median(t) for name, t in times.items()}}  # fmt: skip


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
