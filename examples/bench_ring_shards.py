"""Ring attention's arithmetic on one GPU: the Open-VC kernel on R key shards, merged by their log-sum-exp, against
the unsplit call; prints a table.

    python examples/bench_ring_shards.py                                   # 75600x40, R = 2 and 4
    python examples/bench_ring_shards.py --shapes 32760x12 --shards 2,3,4 --smooth-k --json ring.json

Per shape (batch 1, head dim 128, N(0, 1) bf16 inputs) the keys and values are cut into R consecutive shards, as R
ranks of a ring would hold them; each shard's call (``attention(..., return_lse=True)``) gets the scales of all keys
(V's per-head absmax and, with --smooth-k, K's per-channel mean), as a ring all-reduces them, so that every shard
quantizes like the unsplit call. The R shard calls and ``merge_attention`` are timed apart (CUDA events, medians,
examples/bench_attention.py's ``time_ms``), the unsplit call likewise; SM and memory clocks are read before the run
and right after each method's timed calls. Accuracy: rel-L2 of the merged output against the unsplit call and, on
sampled query rows, both against float64 attention; the largest lse difference from the unsplit call.
"""

import argparse
import random

import torch
from bench_attention import attention_flop, finish_run, log, sampled_exact, shapes, start_run, tflops, time_ms

from openvc_diffusers import cli
from openvc_diffusers.gpu_state import clocks
from openvc_diffusers.metrics import rel_l2
from openvc_kernels import attention, merge_attention
from openvc_kernels.quant import mean_keys
from openvc_kernels.support import HEAD_DIM

SHAPES = "75600x40"
"""Wan 14B 720p (tokens x heads)."""
SHARDS = "2,4"
SAMPLED_ROWS = 256


def shard_counts(text: str) -> list[int]:
    """An argparse type: comma-separated shard counts R, each an integer >= 2, each once."""
    counts = []
    for part in text.split(","):
        try:
            count = int(part)
        except ValueError:
            count = None
        if count is None or count < 2:
            raise argparse.ArgumentTypeError(f"{part!r} in {text!r} is not a shard count: expected integers >= 2")
        if count in counts:
            raise argparse.ArgumentTypeError(f"shard count {count} given more than once in {text!r}")
        counts.append(count)
    return counts


def shared_scales(k: torch.Tensor, v: torch.Tensor, smooth_k: bool) -> dict:
    """What a ring all-reduces before its shards quantize: V's per-head absmax, K's per-channel mean over the keys
    the unsplit call's mean reads (smooth_k; ``quant.mean_keys``)."""
    scales = {"v_absmax": v.abs().amax(dim=(1, 3)).float()}
    if smooth_k:
        scales["k_mean"] = mean_keys(k).mean(dim=1, dtype=torch.float32)
    return scales


def run_shards(q, k_shards, v_shards, options: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [attention(q, k, v, return_lse=True, **options) for k, v in zip(k_shards, v_shards)]


def bench_shape(seq: int, heads: int, counts: list[int], smooth_k: bool) -> list[dict]:
    q, k, v = (torch.randn(1, seq, heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flop = attention_flop(q, k)
    rows = torch.randint(0, seq, (SAMPLED_ROWS,), device="cuda")
    exact = sampled_exact(q, k, v, rows)
    unsplit_ms = time_ms(lambda: attention(q, k, v, return_lse=True, smooth_k=smooth_k), [[]])
    unsplit_clocks = clocks()
    unsplit, unsplit_lse = attention(q, k, v, return_lse=True, smooth_k=smooth_k)
    log(f"  unsplit        {unsplit_ms:9.3f} ms  {tflops(flop, unsplit_ms):6.0f} TFLOP/s  (then: {unsplit_clocks})")
    options = dict(smooth_k=smooth_k, **shared_scales(k, v, smooth_k))
    results = []
    for count in random.sample(counts, len(counts)):
        k_shards, v_shards = k.tensor_split(count, dim=1), v.tensor_split(count, dim=1)
        shards_ms = time_ms(lambda: run_shards(q, k_shards, v_shards, options), [[]])
        shards_clocks = clocks()
        parts = run_shards(q, k_shards, v_shards, options)
        outs, lses = [out for out, _ in parts], [lse for _, lse in parts]
        merge_ms = time_ms(lambda: merge_attention(outs, lses), [[]])
        merge_clocks = clocks()
        merged, merged_lse = merge_attention(outs, lses)
        row = dict(
            seq=seq, heads=heads, label=f"{seq}x{heads}", shards=count, smooth_k=smooth_k,
            ms={"unsplit": unsplit_ms, "shards": shards_ms, "merge": merge_ms},
            clocks_after={"unsplit": unsplit_clocks, "shards": shards_clocks, "merge": merge_clocks},
            rel_l2_vs_unsplit=rel_l2(merged, unsplit),
            lse_max_diff_vs_unsplit=(merged_lse - unsplit_lse).abs().max().item(),
            rel_l2_vs_float64=rel_l2(merged[:, rows], exact),
            unsplit_rel_l2_vs_float64=rel_l2(unsplit[:, rows], exact),
        )
        row["ring_over_unsplit"] = (shards_ms + merge_ms) / unsplit_ms
        log(
            f"  R={count}: shards {shards_ms:9.3f} ms, merge {merge_ms:7.3f} ms  (then: {merge_clocks}); "
            f"rel-L2 vs unsplit {row['rel_l2_vs_unsplit']:.4f}"
        )
        results.append(row)
    return sorted(results, key=lambda r: r["shards"])


def table(rows: list[dict]) -> str:
    head = (
        f"{'S x H':>11} | {'R':>2} | {'unsplit ms':>10} | {'shards ms':>9} | {'merge ms':>8} | {'x unsplit':>9} | "
        f"{'L2 vs unsplit':>13} | {'lse diff':>8} | {'L2 vs f64':>9} | {'unsplit f64':>11}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        ms = r["ms"]
        lines.append(
            f"{r['label']:>11} | {r['shards']:>2} | {ms['unsplit']:10.2f} | {ms['shards']:9.2f} | {ms['merge']:8.3f} | "
            f"{r['ring_over_unsplit']:9.3f} | {r['rel_l2_vs_unsplit']:13.4f} | {r['lse_max_diff_vs_unsplit']:8.4f} | "
            f"{r['rel_l2_vs_float64']:9.4f} | {r['unsplit_rel_l2_vs_float64']:11.4f}"
        )
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", type=shapes, default=SHAPES, help="comma-separated SxH (default: %(default)s)")
    parser.add_argument(
        "--shards", type=shard_counts, default=SHARDS, help="comma-separated shard counts R (default: %(default)s)"
    )
    parser.add_argument("--smooth-k", action="store_true", help="K smoothing, with the all-keys mean on every shard")
    parser.add_argument(
        "--json",
        type=cli.writable_file,
        default="bench_ring_shards.json",
        help="where to write the rows (default: %(default)s)",
    )
    parser.add_argument("--seed", type=cli.seed, default=0, help="order of the shard counts and the inputs")
    args = parser.parse_args(argv)
    shortest = min(seq for seq, _ in args.shapes)
    if max(args.shards) > shortest:
        parser.error(f"--shards {max(args.shards)} is more shards than the {shortest} keys of the shortest shape")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    meta = start_run("bench_ring_shards.py", args.seed)
    rows = []
    for seq, heads in args.shapes:
        log(f"S={seq} H={heads}")
        with torch.inference_mode():
            rows.extend(bench_shape(seq, heads, args.shards, args.smooth_k))
        torch.cuda.empty_cache()
    finish_run(meta, rows, args.json)
    log(table(rows))
    return rows


if __name__ == "__main__":
    main()
