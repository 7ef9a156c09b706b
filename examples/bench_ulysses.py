"""Ulysses sequence parallelism on one Wan 14B-shaped transformer block: one GPU against P GPUs, with Open-VC FP8
and FlashAttention-4 BF16 attention; prints a table.

    torchrun --nproc-per-node 2 examples/bench_ulysses.py                # 720p (75,600 tokens), 40 heads
    torchrun --nproc-per-node 2 examples/bench_ulysses.py --size 480p --iters 20 --json out.json
    torchrun --nproc-per-node 8 examples/bench_ulysses.py --heads 56     # MiniMax-shaped: 56 heads, dim 7168
    torchrun --nproc-per-node 2 examples/bench_ulysses.py --tiny         # tiny random Wan, CPU processes over gloo

One process per GPU, over NCCL; P, the Ulysses degree, is the number of processes and must divide the head count
and the token count. The model is WanTransformer3DModel with one block of Wan 14B's shape (40 heads x 128, dim
5120, ffn 13824; --heads changes the head count and the width with it), seeded random weights (rank 0's, broadcast),
in bfloat16 with the modules diffusers keeps in float32 as from_pretrained loads it. Its input: seeded random
latents of an 81-frame video (21 x 90 x 160 at 720p, 21 x 60 x 104 at 480p; --frames, --height and --width set
the latent size), 512 x 4096 random text embeddings, timestep 500.

Per backend (openvc: Open-VC FP8; fa4: FlashAttention-4 BF16, skipped with a note where it cannot run), every
rank builds the model afresh and runs it twice:
  1 GPU    openvc_diffusers.apply(model, config): each rank runs the whole block on its own GPU
  P GPUs   the same model with parallel.ulysses_degree P: diffusers' context-parallel hooks give each rank 1/P
           of the sequence, and each self-attention call exchanges it for 1/P of the heads (all-to-all) and back
Each run: one untimed warm-up forward, then --iters timed forwards. CUDA events mark each forward, each
self-attention call, the attention backend call inside it (the kernel with its preparation) and the call's
all-to-all exchanges (diffusers' ``_all_to_all_single``: q, k and v there, the output back, packing excluded; a
rank's exchange also waits for the slowest rank). Per rank: medians over the timed forwards and calls, gathered
to rank 0. The P-GPU forward time is the slowest rank's; the 1-GPU figures are rank 0's. Accuracy: rel-L2 of each
rank's P-GPU output (diffusers gathers the whole output on every rank) against its 1-GPU output. The FP8 scales
are computed after the exchange, so the two should be nearly or exactly identical: the target is rel-L2 <= 1e-3.

--tiny runs the same code on openvc_diffusers.tiny's transformer (2 heads, 2 blocks, 160 tokens) in float32 on
CPU processes over gloo, Open-VC through its PyTorch reference: a test of the script, not a benchmark.
"""

import argparse
import gc
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
from contextlib import ExitStack, contextmanager
from unittest import mock

import diffusers
import diffusers.models.attention_dispatch as dispatch_module
import torch
import torch.distributed as dist
from bench_pipeline import (
    CONFIGS,
    EXPECTED,
    SIZES,
    WAN_14B_BLOCK,
    elapsed_ms,
    make_inputs,
    mark,
)
from bench_pipeline import log as print_line
from diffusers import WanTransformer3DModel

import openvc_diffusers
import openvc_diffusers.backend as backend_module
import openvc_diffusers.processors.base as processor_base
from openvc_diffusers import cli
from openvc_diffusers.backends import fa4_unavailable_reason
from openvc_diffusers.metrics import rel_l2
from openvc_diffusers.tiny import cast_like_from_pretrained, tiny_wan_inputs, tiny_wan_transformer

BACKENDS = ("openvc", "fa4")
HEAD_DIM = WAN_14B_BLOCK["attention_head_dim"]
PATCH = WAN_14B_BLOCK["patch_size"]
"""Wan's (frames, height, width) patch; the tiny model has the same."""
TIMESTEP = 500.0
REL_L2_TARGET = 1e-3
SPANS = ("self_call", "attention", "all_to_all")
"""What the timer marks in each self-attention call: the whole call, the backend call, the exchanges."""
TIMED_FUNCTIONS = ((backend_module, "run", "attention"), (dispatch_module, "_all_to_all_single", "all_to_all"))
"""The functions a self-attention call makes, where it looks them up, and the span each one marks: the backend call
(``openvc_diffusers.backend``) and the exchanges of diffusers' Ulysses (``attention_dispatch``)."""


def log(message: str) -> None:
    if dist.get_rank() == 0:
        print_line(message)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--backends",
        type=cli.names_from(BACKENDS, "backend"),
        default=list(BACKENDS),
        help="comma-separated (default: openvc,fa4)",
    )
    parser.add_argument(
        "--heads",
        type=cli.positive_int,
        help="attention heads of 128 (default: 40, Wan 14B's); the width is heads x 128",
    )
    parser.add_argument("--size", choices=SIZES, help="latent size of an 81-frame video (default: 720p)")
    for name in ("frames", "height", "width"):
        parser.add_argument(f"--{name}", type=cli.positive_int, help=f"latent {name}, in place of --size's")
    parser.add_argument(
        "--iters", type=cli.positive_int, default=10, help="timed forwards per run (default: %(default)s)"
    )
    parser.add_argument(
        "--tiny", action="store_true", help="the tiny random Wan, float32 on CPU processes over gloo (a smoke test)"
    )
    parser.add_argument(
        "--json",
        type=cli.writable_file,
        default="bench_ulysses.json",
        help="where rank 0 writes the results (default: %(default)s)",
    )
    parser.add_argument("--seed", type=cli.seed, default=0, help="weights and inputs (default: 0)")
    args = parser.parse_args(argv)
    full_size = [f"--{n}" for n in ("heads", "size", "frames", "height", "width") if getattr(args, n) is not None]
    if args.tiny and full_size:
        parser.error(f"--tiny has its own model and size: {', '.join(full_size)} do not apply")
    if args.tiny:
        args.heads = tiny_wan_transformer().config.num_attention_heads
        args.latent = tuple(tiny_wan_inputs()["hidden_states"].shape[2:])
        return args
    if not torch.cuda.is_available():
        parser.error("the benchmark needs CUDA GPUs, one per process; --tiny runs on the CPU")
    args.heads = args.heads or WAN_14B_BLOCK["num_attention_heads"]
    preset = SIZES[args.size or "720p"]
    args.latent = tuple(given or default for given, default in zip((args.frames, args.height, args.width), preset))
    if any(n % p for n, p in zip(args.latent, PATCH)):
        parser.error(f"latent {'x'.join(map(str, args.latent))} does not divide into Wan's {PATCH} patches")
    return args


def video_tokens(latent: tuple[int, int, int]) -> int:
    return math.prod(n // p for n, p in zip(latent, PATCH))


def launched_degree(args: argparse.Namespace, argv: list[str]) -> int:
    """The world size torchrun gave this process, checked against the model before any process group starts."""
    command = shlex.join(["torchrun", "--nproc-per-node", "2", "examples/bench_ulysses.py", *argv])
    if "WORLD_SIZE" not in os.environ:
        raise SystemExit(f"bench_ulysses.py runs one process per GPU; launch it with torchrun: {command}")
    degree = int(os.environ["WORLD_SIZE"])
    if degree < 2:
        raise SystemExit(f"bench_ulysses.py compares 1 GPU with P >= 2 (the process count), got 1 process: {command}")
    if args.heads % degree:
        divisors = ", ".join(str(p) for p in range(2, args.heads + 1) if args.heads % p == 0)
        raise SystemExit(
            f"{args.heads} attention heads do not divide among {degree} processes: the Ulysses degree (the process "
            f"count) must divide the head count; for {args.heads} heads run {divisors} processes"
        )
    tokens = video_tokens(args.latent)
    if tokens % degree:
        raise SystemExit(
            f"{tokens} video tokens (latent {'x'.join(map(str, args.latent))}) do not divide among {degree} processes"
        )
    return degree


def init_distributed(tiny: bool) -> torch.device:
    """This rank's process group and device: NCCL on the GPU torchrun's LOCAL_RANK names, gloo on the CPU."""
    if tiny:
        dist.init_process_group("gloo")
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)  # device_id: communicators bound to this GPU up front
    return device


def gather(value) -> list | None:
    """``value`` of every rank, in rank order, on rank 0 (None elsewhere)."""
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(value, gathered, dst=0)
    return gathered


def gpu_clocks(device: torch.device) -> str | None:
    """SM clock, memory clock and power draw of this rank's GPU, from nvidia-smi; None on the CPU or without it."""
    if device.type != "cuda":
        return None
    uuid = torch.cuda.get_device_properties(device).uuid
    query = [
        "nvidia-smi",
        f"--id=GPU-{uuid}",
        "--query-gpu=clocks.sm,clocks.mem,power.draw",
        "--format=csv,noheader",
    ]
    try:
        done = subprocess.run(query, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else f"nvidia-smi failed: {done.stdout.strip()}"


def build_model(args: argparse.Namespace, device: torch.device) -> WanTransformer3DModel:
    if args.tiny:
        model = tiny_wan_transformer(seed=args.seed)
    else:
        config = {**WAN_14B_BLOCK, "num_attention_heads": args.heads}
        torch.manual_seed(args.seed)
        with device:  # initialised on the GPU: seconds rather than a minute on the CPU
            model = cast_like_from_pretrained(WanTransformer3DModel(**config), torch.bfloat16).eval()
    # Seeded initialisation already gives identical GPUs the same weights; rank 0's make sure of it, which the
    # comparison with one GPU rests on.
    for tensor in model.state_dict().values():
        dist.broadcast(tensor, src=0)
    return model


def block_inputs(model: WanTransformer3DModel, latent: tuple[int, int, int], seed: int, device) -> dict:
    noise, (text,) = make_inputs(model, latent, False, seed, device)  # drawn on the CPU: the same on every rank
    timestep = torch.full((1,), TIMESTEP, device=device)
    return dict(hidden_states=noise.to(model.dtype), timestep=timestep, encoder_hidden_states=text, return_dict=False)


class SelfAttentionTimer:
    """Marks on the device's timeline, without synchronising, around each self-attention call of Open-VC's
    processors, the attention backend call inside it and its all-to-all exchanges.

    While ``timing()`` is active it wraps ``OpenVCProcessorBase._attend`` and the functions of ``TIMED_FUNCTIONS`` in
    their modules, so the package runs unchanged.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.calls: list[dict[str, list]] = []
        """Per self-attention call since the last ``take_ms``: (start, end) marks per span in SPANS."""
        self._open: dict[str, list] | None = None  # the self-attention call under way, if one is

    @contextmanager
    def timing(self):
        base = processor_base.OpenVCProcessorBase
        with ExitStack() as stack:
            stack.enter_context(mock.patch.object(base, "_attend", self._timed_attend(base._attend)))
            for module, name, span in TIMED_FUNCTIONS:
                wrapped = self._timed(span, getattr(module, name))
                stack.enter_context(mock.patch.object(module, name, wrapped))
            yield self

    def _timed_attend(self, attend):
        def timed(processor, attn, q, k, v, *, is_cross, **kwargs):
            if is_cross:
                return attend(processor, attn, q, k, v, is_cross=is_cross, **kwargs)
            self._open = {span: [] for span in SPANS}
            out = self._timed("self_call", attend)(processor, attn, q, k, v, is_cross=is_cross, **kwargs)
            self.calls.append(self._open)
            self._open = None
            return out

        return timed

    def _timed(self, span: str, fn):
        def timed(*args, **kwargs):
            if self._open is None:  # cross-attention's backend call
                return fn(*args, **kwargs)
            start = mark(self.device)
            out = fn(*args, **kwargs)
            self._open[span].append((start, mark(self.device)))
            return out

        return timed

    def take_ms(self) -> list[dict[str, float]]:
        """ms per span (exchanges summed) of each self-attention call since the last take; call it once the device
        has finished them."""
        calls = [{span: sum(elapsed_ms(*marks) for marks in call[span]) for span in SPANS} for call in self.calls]
        self.calls = []
        return calls


def forward(model, inputs: dict, timer: SelfAttentionTimer) -> tuple[torch.Tensor, float, list[dict[str, float]]]:
    """One forward: its output, its ms and its self-attention calls' ms."""
    start = mark(timer.device)
    out = model(**inputs)[0]
    end = mark(timer.device)
    if timer.device.type == "cuda":
        end.synchronize()
    return out, elapsed_ms(start, end), timer.take_ms()


def run_config(model, name: str, config: dict, inputs: dict, args, timer, label: str) -> tuple[dict, torch.Tensor]:
    """Open-VC with ``config`` on ``model``, one warm-up and ``args.iters`` timed forwards: this rank's figures and
    its last output."""
    processor = openvc_diffusers.apply(model, config)
    with torch.no_grad():
        # Kernel compilation, NCCL's first exchange and the allocator's growth land here, not in the timed forwards.
        forward(model, inputs, timer)
        processor.calls.clear()
        dist.barrier()
        forwards, calls = [], []
        for i in range(args.iters):
            out, ms, call_ms = forward(model, inputs, timer)
            forwards.append(ms)
            calls += call_ms
            spans = ", ".join(f"{span} {statistics.median(c[span] for c in call_ms):.2f}" for span in SPANS)
            log(f"    {label} {i + 1}/{args.iters}: forward {ms:.2f} ms; per self-attention call (ms): {spans}")
    figures = {
        "rank": dist.get_rank(),
        "forward_ms": statistics.median(forwards),
        "forwards_ms": forwards,
        **{f"{span}_ms": statistics.median(c[span] for c in calls) for span in SPANS},
        "calls": {f"{kind}:{backend}": n for (kind, backend), n in sorted(processor.calls.items())},
        "clocks_after": gpu_clocks(timer.device),
    }
    taken = {backend for kind, backend in processor.calls if kind == "self"}
    if not taken <= EXPECTED[name]:
        figures["fallback"] = f"self-attention went to {', '.join(sorted(taken))}, not only {', '.join(EXPECTED[name])}"
    return figures, out


def unavailable_reason(name: str, device: torch.device, dtype: torch.dtype) -> str | None:
    if name != "fa4":
        return None  # openvc runs everywhere: the kernel on Hopper, the reference on the CPU
    return fa4_unavailable_reason(torch.empty(1, 1, 1, HEAD_DIM, device=device, dtype=dtype), has_mask=False)


def bench_backend(name: str, args, degree: int, timer: SelfAttentionTimer) -> dict:
    """One backend on 1 GPU and on ``degree`` GPUs: every rank's figures and the summary, on rank 0."""
    device = timer.device
    reason = unavailable_reason(name, device, torch.float32 if args.tiny else torch.bfloat16)
    if reason:
        log(f"{name}: skipped: {reason}")
        return {"available": False, "reason": reason}
    model = build_model(args, device)
    inputs = block_inputs(model, args.latent, args.seed, device)
    config = {**CONFIGS[name], "min_tokens": 0}  # min_tokens 0: the tiny model's 160 tokens take the FP8 path too
    log(f"{name}: 1 GPU")
    single, single_out = run_config(model, name, config, inputs, args, timer, "1 GPU")
    log(f"{name}: {degree} GPUs (Ulysses)")
    ulysses_config = {**config, "parallel": {"ulysses_degree": degree}}
    ulysses, ulysses_out = run_config(model, name, ulysses_config, inputs, args, timer, f"{degree} GPUs")
    ulysses["rel_l2_vs_1gpu"] = rel_l2(ulysses_out, single_out)
    ulysses["identical_to_1gpu"] = torch.equal(ulysses_out, single_out)
    singles, ulysses_ranks = gather(single), gather(ulysses)
    if dist.get_rank() != 0:
        return {}
    resolved = openvc_diffusers.load_config(config).to_dict()
    row = {"available": True, "config": resolved, "single": singles, "ulysses": ulysses_ranks}
    row["summary"] = summarize(singles, ulysses_ranks)
    s = row["summary"]
    log(
        f"{name}: {s['forward_ms_1gpu']:.2f} ms per forward on 1 GPU, {s['forward_ms']:.2f} ms on {degree} "
        f"({s['speedup']:.2f}x); rel-L2 vs 1 GPU {s['rel_l2_vs_1gpu']:.2e} (target <= {REL_L2_TARGET:g})"
    )
    for fallback in (r["fallback"] for r in singles + ulysses_ranks if "fallback" in r):
        log(f"    WARNING: {name}: {fallback} (reasons are logged above)")
    return row


def summarize(singles: list[dict], ulysses: list[dict]) -> dict:
    def over_ranks(key: str) -> dict:
        values = [r[key] for r in ulysses]
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    forward_ms = max(r["forward_ms"] for r in ulysses)  # the slowest rank sets the pace
    return {
        "forward_ms_1gpu": singles[0]["forward_ms"],
        "forward_ms": forward_ms,
        "speedup": singles[0]["forward_ms"] / forward_ms,
        "attention_ms_1gpu": singles[0]["attention_ms"],
        "attention_ms": over_ranks("attention_ms"),
        "all_to_all_ms": over_ranks("all_to_all_ms"),
        "self_call_ms": over_ranks("self_call_ms"),
        "rel_l2_vs_1gpu": max(r["rel_l2_vs_1gpu"] for r in ulysses),
        "identical_to_1gpu": all(r["identical_to_1gpu"] for r in ulysses),
        "fallback": any("fallback" in r for r in singles + ulysses),
    }


def table(results: dict) -> str:
    degree = results["meta"]["degree"]
    head = (
        f"{'backend':>7} | {'P':>2} | {'fwd ms 1 GPU':>12} | {'fwd ms P GPUs':>13} | {'speedup':>7} | "
        f"{'attn ms 1 GPU':>13} | {'attn ms P GPUs: med [min, max]':>30} | {'all-to-all ms: med [min, max]':>29} | "
        "rel-L2 vs 1 GPU"
    )
    lines = [head, "-" * len(head)]
    for name, row in results["backends"].items():
        if not row["available"]:
            lines.append(f"{name:>7} | {degree:>2} | skipped: {row['reason']}")
            continue
        s = row["summary"]
        lines.append(
            f"{name:>7} | {degree:>2} | {s['forward_ms_1gpu']:12.2f} | {s['forward_ms']:13.2f} | {s['speedup']:6.2f}x"
            f" | {s['attention_ms_1gpu']:13.2f} | {spread(s['attention_ms']):>30} | {spread(s['all_to_all_ms']):>29}"
            f" | {s['rel_l2_vs_1gpu']:.2e}{flags(s)}"
        )
    return "\n".join(lines)


def flags(summary: dict) -> str:
    marks = {
        "identical": summary["identical_to_1gpu"],
        "ABOVE TARGET": summary["rel_l2_vs_1gpu"] > REL_L2_TARGET,
        "FALLBACK": summary["fallback"],
    }
    return "".join(f"  {word}" for word, shown in marks.items() if shown)


def spread(stats: dict) -> str:
    return f"{stats['median']:.2f} [{stats['min']:.2f}, {stats['max']:.2f}]"


def gpu_lines(results: dict) -> list[str]:
    """Each rank's device, and its clocks (SM, memory, power) before the run and after each backend's P-GPU run."""
    lines = []
    for rank in results["meta"]["ranks"]:
        after = [
            f"after {name}: {row['ulysses'][rank['rank']]['clocks_after']}"
            for name, row in results["backends"].items()
            if row["available"]
        ]
        clocks = "; ".join([f"before: {rank['clocks_before']}", *after]) if rank["clocks_before"] else "no nvidia-smi"
        lines.append(f"rank {rank['rank']}: {rank['device']} ({clocks})")
    return lines


def main(argv=None) -> dict | None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    degree = launched_degree(args, argv)
    device = init_distributed(args.tiny)
    try:
        return bench(args, degree, device)
    finally:
        # The models, their hooks and device meshes hold the process groups in reference cycles: collected at
        # interpreter exit, gloo's groups are torn down too late and abort the process now and then.
        gc.collect()
        dist.destroy_process_group()


def bench(args: argparse.Namespace, degree: int, device: torch.device) -> dict | None:
    ranks = gather(
        {
            "rank": dist.get_rank(),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "clocks_before": gpu_clocks(device),
        }
    )
    tokens = video_tokens(args.latent)
    meta = {
        "model": "tiny" if args.tiny else f"Wan 14B-shaped block, {args.heads} heads",
        "config": {**WAN_14B_BLOCK, "num_attention_heads": args.heads} if not args.tiny else "openvc_diffusers.tiny",
        "dtype": "float32" if args.tiny else "bfloat16",
        "latent": list(args.latent),
        "tokens": tokens,
        "heads": args.heads,
        "degree": degree,
        "iters": args.iters,
        "seed": args.seed,
        "rel_l2_target": REL_L2_TARGET,
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "ranks": ranks,
    }
    log(
        f"{meta['model']}, {meta['dtype']}: latent {'x'.join(map(str, args.latent))}, {tokens} tokens, "
        f"1 GPU vs {degree} ({dist.get_backend()}), {args.iters} timed forwards per run"
    )
    timer = SelfAttentionTimer(device)
    with timer.timing():
        backends = {name: bench_backend(name, args, degree, timer) for name in args.backends}
    if dist.get_rank() != 0:
        return None
    results = {"meta": meta, "backends": backends}
    cli.create_parent(args.json)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)
    log(f"wrote {args.json}")
    log("\n".join(gpu_lines(results)))
    log(table(results))
    return results


if __name__ == "__main__":
    main()
