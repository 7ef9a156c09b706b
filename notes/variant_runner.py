"""What the forward-kernel probes that compile variants of their own share: their SASS dumped for sm_90a (no GPU
needed), and a same-process run on a Hopper GPU that checks each variant's output and times them in turn.

A probe module names its variants in ``VARIANTS`` and compiles one with ``compile_variant(name)`` (most through
``compile_with_softmax``); its command line is ``main(__doc__, probe)``: ``--sass DIR`` dumps, else it runs.
"""

import argparse
import importlib
import os
import statistics
import subprocess
import sys

SHAPES = ((32_760, 12), (75_600, 40))
TAU = 128**-0.5
TIMED_MS = 20_000
"""The timed calls' total, all variants together, at each shape."""
CHECKED_ROWS = 256
"""Query rows whose output is compared with float64 attention."""


def compile_with_softmax(softmax_class: type, config=None):
    """The forward kernel of ``config`` (default: the shipped ``ForwardConfig()``) with ``softmax_class`` as each
    consumer thread's softmax, compiled for sm_90a (no GPU needed)."""
    from openvc_kernels.ops import compile_attention
    from openvc_kernels.sm90.config import ForwardConfig
    from openvc_kernels.sm90.fwd import ExpCastAttentionSm90

    variant = type("Variant", (ExpCastAttentionSm90,), {"softmax_class": softmax_class})
    return compile_attention(ForwardConfig() if config is None else config, variant)


def launch(kernel, args) -> None:
    """One launch of a compiled forward kernel on ``args`` (``ops.forward_args``), the tail split's counters zeroed
    first, as ``ops.attention_prepared`` allocates them: a launch on counters left over from the one before never
    merges its pieces (less work, a wrong output)."""
    args.arrivals.zero_()
    kernel(*args)


def dump_sass(folder: str, probe: str) -> None:
    """One subprocess per variant of module ``probe``: the DSL reads its dump settings at import."""
    for name in importlib.import_module(probe).VARIANTS:
        dump = os.path.join(folder, name.replace(" ", "_").replace(",", ""))
        os.makedirs(dump, exist_ok=True)
        env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="sass", CUTE_DSL_DUMP_DIR=dump)
        script = f"import {probe} as p; p.compile_variant({name!r})"
        subprocess.run([sys.executable, "-c", script], env=env, check=True, cwd=os.path.dirname(__file__))


def run(probe: str) -> None:
    """Every variant of module ``probe`` on the same prepared N(0, 1) inputs: whether its output is finite, its
    distance from the first variant's, its error against float64 on ``CHECKED_ROWS`` rows; then the variants timed
    interleaved (``bench_attention.time_interleaved``, back to back, about ``TIMED_MS`` in all; two input sets
    alternated; each launch includes zeroing its counters): each one's median, and the median over rounds of its
    time over the first variant's in the same round, so that the SM clock's drift weighs on all alike."""
    import torch

    from openvc_kernels.ops import forward_args, prepare

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
    from bench_attention import median_over, time_interleaved

    module = importlib.import_module(probe)
    print(torch.cuda.get_device_name(), flush=True)
    kernels = {name: module.compile_variant(name) for name in module.VARIANTS}
    first = next(iter(kernels))
    for seq, heads in SHAPES:
        flop = 4 * seq * seq * heads * 128
        inputs = [[torch.randn(1, seq, heads, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
                  for _ in range(2)]
        sets = [forward_args(prepare(*qkv), torch.empty_like(qkv[0]), softmax_scale=TAU, window=4, split_tail=True)
                for qkv in inputs]
        q, k, v = inputs[0]
        rows = torch.randperm(seq, device="cuda")[:CHECKED_ROWS]
        exact = torch.nn.functional.scaled_dot_product_attention(
            *(t.double().transpose(1, 2) for t in (q[:, rows], k, v))
        ).transpose(1, 2)
        outs = {}
        for name, kernel in kernels.items():
            sets[0].out.fill_(float("nan"))
            launch(kernel, sets[0])
            outs[name] = sets[0].out.float().clone()
        for name, out in outs.items():
            apart = ((out - outs[first]).norm() / outs[first].norm()).item()
            error = ((out[:, rows].double() - exact).norm() / exact.norm()).item()
            print(f"{seq}x{heads} {name:>24}: finite {bool(out.isfinite().all())}, rel-L2 vs {first} {apart:.2e}, "
                  f"vs float64 {error:.4%}", flush=True)
        # The calls take the input set's index (time_interleaved passes it): set i % 2 in round i.
        calls = [lambda i, kernel=kernel, sets=sets: launch(kernel, sets[i]) for kernel in kernels.values()]
        times = time_interleaved(calls, [[0], [1]], "back_to_back", TIMED_MS)
        for name, own in zip(kernels, times):
            ms = statistics.median(own)
            print(f"{seq}x{heads} {name:>24}: {ms:8.3f} ms {flop / ms / 1e9:7.0f} TFLOP/s, "
                  f"{100 * median_over(own, times[0]):+6.2f}% over {first} ({len(own)} rounds)", flush=True)
        del inputs, sets, outs
        torch.cuda.empty_cache()


def main(doc: str, probe: str) -> None:
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sass", metavar="DIR", help="compile every variant for sm_90a and dump SASS into DIR")
    args = parser.parse_args()
    dump_sass(args.sass, probe) if args.sass else run(probe)
