"""Time Open-VC FP8 ExpCast attention against FlashAttention-4 and cuDNN BF16 on one GPU; prints a table.

    python examples/bench_attention.py                       # the four video shapes, JSON to bench_attention.json
    python examples/bench_attention.py --shapes 32760x12 --json out.json
    python examples/bench_attention.py --repair                # V residual repair and K smoothing sweep
    python examples/bench_attention.py --inputs outputs/qkv.safetensors   # real activations (examples/capture.py)

Per shape (batch 1, head dim 128, N(0, 1) bf16 inputs, two input sets rotated), in a random order: the Open-VC
kernel on prepared inputs, the preparation alone, the complete Open-VC call, FlashAttention-4 BF16 and torch
SDPA on cuDNN BF16. Median of CUDA-event-timed calls enqueued back to back; TFLOP/s = 4 S^2 H 128 / time.
Accuracy: rel-L2 of Open-VC against FA4 and, on sampled query rows, against float64 attention.

--inputs FILE times the same methods on the Q, K, V that examples/capture.py saved (one row per captured layer
and step, its own tensors every call; float32 captures are cast to bf16; TFLOP/s = 4 B Sq Sk H D / time).

--repair instead sweeps V residual repair (rho in REPAIR_RATIOS ranked by residual energy, and rho = 0.005 with the
"attention" ranking) with and without K smoothing at (73397, 7) and (75600, 40) on three kinds of inputs:
N(0, 1), V with heavy-tailed (log-normal) token norms, and K with a few channels carrying large offsets; per
setting the complete call's time (the median of three rounds that visit the settings in shuffled order) and its
rel-L2 against float64 attention on sampled query rows. SM and memory clocks are read before the run and right after
each method's timed calls (the clocks it ran at: the H200 holds its power cap by lowering the SM clock).
"""

import argparse
import json
import os
import random
import re
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from openvc_diffusers import cli
from openvc_diffusers.gpu_state import clocks
from openvc_diffusers.metrics import rel_l2
from openvc_kernels import attention, attention_prepared, prepare
from openvc_kernels.support import HEAD_DIM

SHAPES = "73397x7,32760x12,75600x40,118800x24"
"""MiniMax-H3 8-way Ulysses shard, Wan2.1-1.3B 480p, Wan 14B 720p, HunyuanVideo 720p (tokens x heads)."""
INPUT_SETS = 2
TIMED_MS = 1500
SAMPLED_ROWS = 256


def log(message: str) -> None:
    print(message, flush=True)


def tflops(flop: float, ms: float) -> float:
    return flop / (ms * 1e-3) / 1e12


def attention_flop(q: torch.Tensor, k: torch.Tensor) -> float:
    """4 B Sq Sk H D: the two matrix products of (B, S, H, D) attention."""
    batch, s_q, heads, dim = q.shape
    return 4.0 * batch * s_q * k.shape[1] * heads * dim


def time_ms(fn, sets, budget_ms: float = TIMED_MS) -> float:
    """Median of per-call CUDA-event times over about ``budget_ms`` of calls rotating through ``sets``, after a
    warm-up call. The calls are enqueued back to back and synchronized once: the host launches ahead of the GPU,
    as in a pipeline, so per-call launch overhead (many small PyTorch ops, FA4's Python) is not timed unless it
    starves the GPU."""
    fn(*sets[0])
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn(*sets[0])
    end.record()
    end.synchronize()
    calls = max(5, round(budget_ms / start.elapsed_time(end)))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(calls)]
    for i, (start, end) in enumerate(events):
        start.record()
        fn(*sets[i % len(sets)])
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def sampled_exact(q, k, v, rows: torch.Tensor) -> torch.Tensor:
    """Float64 attention of batch item 0 for the query rows ``rows``, one head at a time: (1, len(rows), H, D)."""
    out = []
    for h in range(q.shape[2]):
        qh, kh, vh = q[0, rows, h].double(), k[0, :, h].double(), v[0, :, h].double()
        p = torch.softmax(qh @ kh.T * q.shape[-1] ** -0.5, dim=-1)
        out.append(p @ vh)
    return torch.stack(out, dim=1)[None]


def run_fa4(q, k, v):
    from flash_attn.cute import flash_attn_func

    out = flash_attn_func(q, k, v)
    return out[0] if isinstance(out, tuple) else out


def run_cudnn(q, k, v):
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def bench_shape(seq: int, heads: int) -> dict:
    sets = [
        [torch.randn(1, seq, heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        for _ in range(INPUT_SETS)
    ]
    return bench_sets(sets, {"seq": seq, "heads": heads, "label": f"{seq}x{heads}"})


def bench_sets(sets: list[list[torch.Tensor]], row: dict) -> dict:
    """Every method on ``sets`` (rotated; each a (q, k, v) of one shape) in random order, then the accuracy
    of Open-VC on the first set; the numbers are added to ``row``."""
    q, k, v = sets[0]
    flop = attention_flop(q, k)
    out = torch.empty_like(q)
    # Each method with a function making its argument sets: the kernel alone takes prepared inputs, made (and
    # refused, for inputs the Hopper kernel cannot take) inside the method's own try.
    methods = {
        "openvc_kernel": (
            lambda p: attention_prepared(p, out, softmax_scale=q.shape[-1] ** -0.5),
            lambda: [[prepare(*s)] for s in sets],
        ),
        "openvc_prepare": (prepare, lambda: sets),
        "openvc_call": (attention, lambda: sets),
        "fa4_bf16": (run_fa4, lambda: sets),
        "cudnn_bf16": (run_cudnn, lambda: sets),
    }
    order = list(methods)
    random.shuffle(order)
    row.update(order=order, ms={}, tflops={})
    for name in order:
        fn, make_args = methods[name]
        try:
            row["ms"][name] = time_ms(fn, make_args())
            row.setdefault("clocks_after", {})[name] = clocks()  # read as the timed calls end: the load's clocks
        except Exception as e:  # a missing backend (FA4 not installed), inputs one cannot take: keep the rest
            row["ms"][name] = float("nan")
            row.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"
        at = row.get("clocks_after", {}).get(name, "")
        if name == "openvc_prepare":  # no attention FLOPs: a rate would mean nothing
            log(f"  {name:15s} {row['ms'][name]:9.3f} ms                  (then: {at})")
            continue
        row["tflops"][name] = tflops(flop, row["ms"][name])
        log(f"  {name:15s} {row['ms'][name]:9.3f} ms  {row['tflops'][name]:6.0f} TFLOP/s  (then: {at})")

    rows = torch.randint(0, q.shape[1], (SAMPLED_ROWS,), device=q.device)
    exact = sampled_exact(q, k, v, rows)
    failed = row.get("errors", {})
    ours = None if "openvc_call" in failed else attention(q, k, v)
    fa4 = None if "fa4_bf16" in failed else run_fa4(q, k, v)
    if ours is not None:
        row["rel_l2_vs_float64"] = rel_l2(ours[:1, rows], exact)
    if fa4 is not None:
        row["fa4_rel_l2_vs_float64"] = rel_l2(fa4[:1, rows], exact)
    if ours is not None and fa4 is not None:
        row["rel_l2_vs_fa4"] = rel_l2(ours, fa4)
    row["speedup_call_over_fa4"] = row["ms"]["fa4_bf16"] / row["ms"]["openvc_call"]
    row["prepare_share_of_call"] = row["ms"]["openvc_prepare"] / row["ms"]["openvc_call"]
    return row


CAPTURE_FORMAT = "openvc-qkv/1"
CAPTURED_NAME = re.compile(r"step(\d+)\.layer(\d+)\.([qkv])")


def check_captured(path: str) -> None:
    """Raises ValueError unless ``path`` is an examples/capture.py file, from its header (no tensors read)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, "pt") as f:
            found = (f.metadata() or {}).get("format")
    except SafetensorError as e:
        raise ValueError(f"{path} is not a safetensors file ({e})") from None
    if found != CAPTURE_FORMAT:
        raise ValueError(f"{path} is not an examples/capture.py file: format {found!r}, expected {CAPTURE_FORMAT!r}")


def load_captured(path: str) -> list[tuple[str, list[torch.Tensor]]]:
    """``(name, [q, k, v])`` per captured step and layer of an examples/capture.py file ("step0.layer15"), in
    step-then-layer order, on the CPU as saved."""
    from safetensors.torch import load_file

    check_captured(path)
    entries = {}
    for key, tensor in load_file(path).items():
        match = CAPTURED_NAME.fullmatch(key)
        if match is None:
            raise ValueError(f"{path}: unexpected tensor {key!r} (expected names like 'step0.layer15.q')")
        entries.setdefault((int(match[1]), int(match[2])), {})[match[3]] = tensor
    for (step, layer), qkv in entries.items():
        if sorted(qkv) != ["k", "q", "v"]:
            raise ValueError(f"{path}: step{step}.layer{layer} has {sorted(qkv)}, expected q, k and v")
    return [(f"step{step}.layer{layer}", [qkv[x] for x in "qkv"]) for (step, layer), qkv in sorted(entries.items())]


def bench_captured(path: str) -> list[dict]:
    rows = []
    for name, qkv in load_captured(path):
        q, k, v = (x.to("cuda", torch.bfloat16 if x.dtype == torch.float32 else x.dtype) for x in qkv)
        batch, s_q, heads, dim = q.shape
        log(f"{name}: B={batch} Sq={s_q} Sk={k.shape[1]} H={heads} D={dim} {q.dtype}")
        label = {"name": name, "batch": batch, "seq": s_q, "seq_k": k.shape[1], "heads": heads, "label": name}
        rows.append(bench_sets([[q, k, v]], label))
        torch.cuda.empty_cache()
    return rows


REPAIR_SHAPES = "73397x7,75600x40"
REPAIR_RATIOS = (0.0, 0.0025, 0.005, 0.01, 0.02)
REPAIR_INPUTS = ("normal", "heavy-tailed V", "K offsets")
REPAIR_TIMED_MS = 900
REPAIR_ROUNDS = 3
ATTENTION_RANKING_RATIO = 0.005
"""The sweep ranks by residual energy (the default); the "attention" ranking is timed at this rho only."""


def repair_inputs(kind: str, seq: int, heads: int) -> list[torch.Tensor]:
    q, k, v = (torch.randn(1, seq, heads, HEAD_DIM, device="cuda") for _ in range(3))
    if kind == "heavy-tailed V":
        v = v * torch.exp(1.5 * torch.randn(1, seq, heads, 1, device="cuda"))  # log-normal token norms
    elif kind == "K offsets":
        channels = torch.randperm(HEAD_DIM, device="cuda")[:4]
        k[..., channels] += 8.0 * torch.randn(1, 1, heads, 4, device="cuda")
    return [x.bfloat16() for x in (q, k, v)]


def bench_repair(seq: int, heads: int) -> list[dict]:
    """Every setting on each kind of inputs: its error once, its time as the median of REPAIR_ROUNDS medians taken
    in shuffled round-robin order, so that the clock drifting under the power cap weighs on every setting alike."""
    rows = []
    for kind in REPAIR_INPUTS:
        q, k, v = repair_inputs(kind, seq, heads)
        sampled = torch.randint(0, seq, (SAMPLED_ROWS,), device="cuda")
        exact = sampled_exact(q, k, v, sampled)
        rankings = [(ratio, "energy") for ratio in REPAIR_RATIOS] + [(ATTENTION_RANKING_RATIO, "attention")]
        settings = [
            dict(repair_ratio=ratio, repair_ranking=ranking, smooth_k=smooth_k)
            for smooth_k in (False, True)
            for ratio, ranking in rankings
        ]
        times = {i: [] for i in range(len(settings))}
        for _ in range(REPAIR_ROUNDS):
            for i in random.sample(range(len(settings)), len(settings)):
                call = lambda q, k, v, options=settings[i]: attention(q, k, v, **options)
                times[i].append(time_ms(call, [[q, k, v]], REPAIR_TIMED_MS / REPAIR_ROUNDS))
        for i, options in enumerate(settings):
            ms = statistics.median(times[i])
            error = rel_l2(attention(q, k, v, **options)[:, sampled], exact)
            rows.append(dict(seq=seq, heads=heads, inputs=kind, ms=ms, rel_l2=error, **options))
            log(
                f"  {kind:14s} smooth_k={options['smooth_k']!s:5s} rho={options['repair_ratio']:<6} "
                f"{options['repair_ranking']:9s} {ms:8.2f} ms  rel-L2 vs f64 {error:.4f}"
            )
    return rows


def repair_table(rows: list[dict]) -> str:
    """Each setting against rho = 0 with the same inputs and K smoothing: time and error changes."""
    head = (
        f"{'S x H':>11} | {'inputs':>14} | smooth_k | {'rho':>6} | {'ranking':>9} | {'ms':>8} | {'+ms %':>6} | "
        f"{'L2 vs f64':>9} | {'L2 change':>9}"
    )
    lines = [head, "-" * len(head)]
    base = {(r["seq"], r["inputs"], r["smooth_k"]): r for r in rows if r["repair_ratio"] == 0.0}
    for r in rows:
        b = base[r["seq"], r["inputs"], r["smooth_k"]]
        lines.append(
            f"{r['seq']:>6}x{r['heads']:<4} | {r['inputs']:>14} | {r['smooth_k']!s:>8} | {r['repair_ratio']:6.4f} | "
            f"{r['repair_ranking']:>9} | "
            f"{r['ms']:8.2f} | {100 * (r['ms'] / b['ms'] - 1):+6.1f} | {r['rel_l2']:9.4f} | "
            f"{100 * (r['rel_l2'] / b['rel_l2'] - 1):+8.1f}%"
        )
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    width = max(11, *(len(r["label"]) for r in rows))  # capture labels ("step12.layer29") run longer than S x H
    head = (
        f"{'S x H':>{width}} | {'kernel':>14} | {'call':>14} | {'prep ms':>7} | {'FA4 BF16':>14} | "
        f"{'cuDNN BF16':>14} | {'x FA4':>5} | {'L2 vs FA4':>9} | {'L2 vs f64':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        ms = r["ms"]

        def cell(name, r=r):
            return f"{r['ms'][name]:6.2f} ms {r['tflops'][name]:4.0f}"

        lines.append(
            f"{r['label']:>{width}} | {cell('openvc_kernel')} | {cell('openvc_call')} | "
            f"{ms['openvc_prepare']:7.2f} | {cell('fa4_bf16')} | {cell('cudnn_bf16')} | "
            f"{r['speedup_call_over_fa4']:5.2f} | {r.get('rel_l2_vs_fa4', float('nan')):9.4f} | "
            f"{r.get('rel_l2_vs_float64', float('nan')):9.4f}"
        )
    return "\n".join(lines)


def shapes(text: str) -> list[tuple[int, int]]:
    """An argparse type: comma-separated SxH, tokens x heads, such as 32760x12."""
    out = []
    for part in text.split(","):
        seq, _, heads = part.partition("x")
        try:
            out.append((cli.positive_int(seq), cli.positive_int(heads)))
        except argparse.ArgumentTypeError:
            where = f" in {text!r}" if part != text else ""
            raise argparse.ArgumentTypeError(
                f"{part!r}{where} is not SxH: tokens x heads, both >= 1, such as 32760x12"
            ) from None
    return out


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--shapes",
        type=shapes,
        help=f"comma-separated SxH (default: {SHAPES}; with --repair: {REPAIR_SHAPES})",
    )
    parser.add_argument(
        "--json",
        type=cli.writable_file,
        default="bench_attention.json",
        help="where to write the rows (default: %(default)s)",
    )
    parser.add_argument("--seed", type=cli.seed, default=0, help="order of the methods and the inputs")
    parser.add_argument("--repair", action="store_true", help="the V residual repair and K smoothing sweep")
    parser.add_argument("--inputs", metavar="FILE", help="time on Q, K, V saved by examples/capture.py instead")
    args = parser.parse_args(argv)
    if args.inputs and args.repair:
        parser.error("--inputs and --repair do not combine: the repair sweep draws its own inputs")
    if args.inputs and args.shapes:
        parser.error("--inputs and --shapes do not combine: the captured tensors have their own shapes")
    if args.inputs and not os.path.isfile(args.inputs):
        parser.error(f"--inputs {args.inputs}: no such file (examples/capture.py writes one)")
    try:
        if args.inputs:
            check_captured(args.inputs)
    except ValueError as e:
        parser.error(f"--inputs {e}")
    if args.shapes is None:
        args.shapes = [] if args.inputs else shapes(REPAIR_SHAPES if args.repair else SHAPES)
    return args


def start_run(script: str, seed: int) -> dict:
    """Exit unless there is a CUDA GPU; seed Python's and torch's generators; the run's metadata (GPU, torch, the
    clocks before), logged."""
    if not torch.cuda.is_available():
        sys.exit(f"{script} needs a CUDA GPU (Hopper for Open-VC)")
    random.seed(seed)
    torch.manual_seed(seed)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "clocks_before": clocks()}
    log(f"{meta['gpu']}, clocks (sm, mem, temp, power) before: {meta['clocks_before']}")
    return meta


def finish_run(meta: dict, rows: list[dict], path: str) -> None:
    """The clocks after into ``meta``, logged; ``meta`` and ``rows`` written to ``path`` as JSON."""
    meta["clocks_after"] = clocks()
    log(f"clocks after: {meta['clocks_after']}")
    cli.create_parent(path)
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    meta = start_run("bench_attention.py", args.seed)
    rows = bench_captured(args.inputs) if args.inputs else []
    for seq, heads in args.shapes:
        log(f"S={seq} H={heads}")
        if args.repair:
            rows.extend(bench_repair(seq, heads))
        else:
            rows.append(bench_shape(seq, heads))
        torch.cuda.empty_cache()
    finish_run(meta, rows, args.json)
    log(repair_table(rows) if args.repair else table(rows))
    return rows


if __name__ == "__main__":
    main()
