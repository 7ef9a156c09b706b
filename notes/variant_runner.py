"""What the forward-kernel probes that compile variants of their own share: their SASS dumped for sm_90a (no GPU
needed), and a same-process run on a Hopper GPU that checks each variant's output and times them in turn.

A probe module names its variants in ``VARIANTS`` and compiles one with ``compile_variant(name)`` (most through
``compile_with_softmax``); its command line is ``main(__doc__, probe)``: ``--sass DIR`` dumps, else it runs.
"""

import argparse
import importlib
import os
import subprocess
import sys

SHAPES = ((32_760, 12), (75_600, 40))
TAU = 128**-0.5
ROUNDS = 3
"""Timing rounds, the variants in turn (every other round in reverse order)."""
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
    distance from the first variant's, its error against float64 on ``CHECKED_ROWS`` rows; then ``ROUNDS`` rounds of
    timings (triton's do_bench, medians; two input sets alternated; each launch includes zeroing its counters)."""
    import torch
    from triton.testing import do_bench

    from openvc_kernels.ops import forward_args, prepare

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
        for rnd in range(ROUNDS):
            for name, kernel in (kernels.items() if rnd % 2 == 0 else reversed(kernels.items())):
                turn = iter(range(10**9))
                call = lambda kernel=kernel, turn=turn, sets=sets: launch(kernel, sets[next(turn) % 2])  # noqa: E731
                ms = do_bench(call, warmup=100, rep=600, return_mode="median")
                print(f"{seq}x{heads} round {rnd} {name:>24}: {ms:8.2f} ms {flop / ms / 1e9:7.0f} TFLOP/s",
                      flush=True)
        del inputs, sets, outs
        torch.cuda.empty_cache()


def main(doc: str, probe: str) -> None:
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sass", metavar="DIR", help="compile every variant for sm_90a and dump SASS into DIR")
    args = parser.parse_args()
    dump_sass(args.sass, probe) if args.sass else run(probe)
