"""Ring attention against the unsplit call, on the reference (CPU): rel-L2 of the merged output of R K/V shards
against one call over the whole sequence, and of both against float64 attention, with repair off and on.

    python notes/ring_accuracy.py            # S = 4096 and 4000 (shards not a multiple of 128), R = 2, 4, 8

A second table: the same ring with each shard's own V absmax or K mean instead of the all-keys ones.

Each rank's part is computed as ``ring.ring_attention`` computes it (``attend_key_shards`` with V's absmax and K's
channel mean over all keys), here in one process: the rank's query shard against every K/V shard, merged.
"""

import functools

import torch

import openvc_kernels
from openvc_diffusers.metrics import rel_l2
from openvc_diffusers.ring import attend_key_shards

HEADS, DIM = 2, 128
DEGREES = (2, 4, 8)


def exact(q, k, v):
    q, k, v = (x.double().transpose(1, 2) for x in (q, k, v))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2)


def ring(q, k, v, degree: int, options: dict, share_v: bool = True, share_k: bool = True) -> torch.Tensor:
    """The ring's output for all queries; ``share_v`` / ``share_k`` False: each shard call's own V absmax / K mean."""
    v_absmax = v.abs().amax(dim=(1, 3)).float() if share_v else None
    k_mean = k.mean(dim=1, dtype=torch.float32) if options["smooth_k"] and share_k else None
    shard = functools.partial(openvc_kernels.reference_attention, **options)
    k_shards, v_shards = k.chunk(degree, dim=1), v.chunk(degree, dim=1)
    parts = [
        attend_key_shards(q_shard, k_shards, v_shards, shard, v_absmax=v_absmax, k_mean=k_mean)
        for q_shard in q.chunk(degree, dim=1)
    ]
    return torch.cat(parts, dim=1)


def inputs(kind: str, seq: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, seq, HEADS, DIM, generator=g) for _ in range(3))
    if kind == "heavy-tailed V":  # 0.5% of the tokens x20: what repair is for
        rows = torch.randperm(seq, generator=g)[: max(1, seq // 200)]
        v[:, rows] *= 20
    if kind == "K offsets":  # +20 on 4 channels: what smoothing is for
        k[..., :4] += 20
    return tuple(x.bfloat16() for x in (q, k, v))


def main() -> None:
    torch.manual_seed(0)
    print("| inputs | S | repair | R | ring vs unsplit | unsplit vs float64 | ring vs float64 |")
    print("|---|---|---|---|---|---|---|")
    for kind in ("N(0,1)", "heavy-tailed V", "K offsets"):
        for seq in (4096, 4000):
            q, k, v = inputs(kind, seq, seed=seq)
            truth = exact(q, k, v)
            for rho in (0.0, 0.005):
                options = dict(repair_ratio=rho, smooth_k=True, window=4)
                whole = openvc_kernels.reference_attention(q, k, v, **options)
                for degree in DEGREES:
                    out = ring(q, k, v, degree, options)
                    print(
                        f"| {kind} | {seq} | {rho} | {degree} | {rel_l2(out, whole):.2e} | "
                        f"{rel_l2(whole, truth):.4%} | {rel_l2(out, truth):.4%} |",
                        flush=True,
                    )
    print()
    print("| K offsets, S = 4096, R = 4 | ring vs unsplit | ring vs float64 |")
    print("|---|---|---|")
    q, k, v = inputs("K offsets", 4096, seed=1)
    options = dict(repair_ratio=0.0, smooth_k=True, window=4)
    whole, truth = openvc_kernels.reference_attention(q, k, v, **options), exact(q, k, v)
    for name, share_v, share_k in (("shared", True, True), ("own V absmax", False, True), ("own K mean", True, False)):
        out = ring(q, k, v, 4, options, share_v=share_v, share_k=share_k)
        print(f"| {name} | {rel_l2(out, whole):.2e} | {rel_l2(out, truth):.4%} |", flush=True)


if __name__ == "__main__":
    main()
