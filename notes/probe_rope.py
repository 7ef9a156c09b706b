"""Device probe: what the rotary embedding costs in an eager Wan step, in diffusers' code and in Open-VC's launch (the
rest of the step is the same for every attention backend, so this is time no attention kernel wins back).

One Wan2.1-1.3B-shaped self-attention module (``WanAttention``, random weights, bf16) with Open-VC's processor, at
each size of ``examples/bench_pipeline.py``, its forward timed three ways, interleaved call by call, each alone
between CUDA events (``bench_attention.time_interleaved``, synchronized), medians: with the rotary embedding applied
by the backend (``openvc_kernels.rotary.rotate_qk``, what the processor does in inference), by diffusers'
``WanAttnProcessor`` code (``wan.backend_rotates`` patched to False), and without it; the tables from the model's own
``rope``, as ``WanTransformer3DModel.forward`` passes them. Beside them ``rotate_qk`` alone, the reference
(diffusers' arithmetic) on Q and K alone, and the floor of any one-pass kernel: a copy of Q and K (the same bytes
read and written once). Per layer, then per step (30 layers). Run on a GPU from the repository root: ``python
notes/probe_rope.py [480p,720p]``.
"""

import importlib.util
import os
import statistics
import sys
from pathlib import Path

import torch

import openvc_diffusers
from openvc_diffusers.gpu_state import clocks
from openvc_diffusers.processors import wan
from openvc_kernels.rotary import rotary_reference, rotate_qk

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from bench_attention import time_interleaved  # noqa: E402

BUDGET_MS = 1500
"""Of calls per size, all of them interleaved: about 30 rounds at 480p."""
bench_pipeline_path = Path(__file__).parents[1] / "examples" / "bench_pipeline.py"


def load_bench_pipeline():
    spec = importlib.util.spec_from_file_location("bench_pipeline_example", bench_pipeline_path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def with_diffusers_rotary(call):
    def run():
        wan.backend_rotates, backend_rotates = (lambda *args: False), wan.backend_rotates
        try:
            return call()
        finally:
            wan.backend_rotates = backend_rotates

    return run


def probe_size(bench, size: str) -> dict:
    config = {**bench.WAN_1_3B, "num_layers": 1}
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = bench.WanTransformer3DModel(**config)
    model = bench.cast_like_from_pretrained(model, torch.bfloat16).eval()
    openvc_diffusers.apply(model, {"min_tokens": 0})
    noise = torch.randn(1, config["in_channels"], *bench.SIZES[size], device="cuda", dtype=torch.bfloat16)
    tokens = bench.tokens(model, bench.SIZES[size])
    attn = model.blocks[0].attn1
    x = torch.randn(1, tokens, attn.inner_dim, device="cuda", dtype=torch.bfloat16)
    heads = config["num_attention_heads"]
    q, k = (torch.randn(1, tokens, heads, 128, device="cuda", dtype=torch.bfloat16) for _ in "qk")
    with torch.no_grad():
        cos, sin = model.rope(noise)
        fused_q, fused_k = rotate_qk(q, k, cos, sin)
        same = all(torch.equal(out, rotary_reference(x, cos, sin)) for out, x in ((fused_q, q), (fused_k, k)))
        calls = {
            "attn1, backend's rotary": lambda: attn(x, rotary_emb=(cos, sin)),
            "attn1, diffusers' rotary": with_diffusers_rotary(lambda: attn(x, rotary_emb=(cos, sin))),
            "attn1, no rotary": lambda: attn(x),
            "rotate_qk": lambda: rotate_qk(q, k, cos, sin),
            "reference on Q and K": lambda: (rotary_reference(q, cos, sin), rotary_reference(k, cos, sin)),
            "copy of Q and K": lambda: (torch.empty_like(q).copy_(q), torch.empty_like(k).copy_(k)),
        }
        times = time_interleaved(list(calls.values()), [()], "synced", BUDGET_MS)
    medians = {name: statistics.median(t) for name, t in zip(calls, times)}
    return {"size": size, "tokens": tokens, "bit-identical": same, **medians}


def main(argv: list[str]) -> None:
    bench = load_bench_pipeline()
    sizes = argv[0].split(",") if argv else list(bench.SIZES)
    for size in sizes:
        if size not in bench.SIZES:
            raise SystemExit(f"size {size!r}: expected one of {', '.join(bench.SIZES)}")
    print(f"clocks before: {clocks()}")
    rows = [probe_size(bench, size) for size in sizes]
    print(f"clocks after: {clocks()}")
    layers = bench.WAN_1_3B["num_layers"]
    for r in rows:
        print(f"{r['size']} ({r['tokens']} tokens): rotate_qk bit-identical to the reference: {r['bit-identical']}")
        print(f"  {'what':<26} | ms per layer | ms per step ({layers} layers)")
        for name in list(r)[3:]:
            print(f"  {name:<26} | {r[name]:12.3f} | {r[name] * layers:8.1f}")
        for way in ("backend's", "diffusers'"):
            cost = r[f"attn1, {way} rotary"] - r["attn1, no rotary"]
            print(f"  {way + ' rotary in attn1':<26} | {cost:12.3f} | {cost * layers:8.1f}")


if __name__ == "__main__":
    main(sys.argv[1:])
