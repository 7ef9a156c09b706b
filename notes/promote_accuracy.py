"""CPU: what longer PV chains cost in accuracy (``reference_attention(promote_every=...)``, the kernel's
``wgmma.PV_PROMOTE_EVERY``), by how peaked the attention is.

The processor's defaults (K smoothing, repair rho 0.005), the wgmma-summing reference, bf16 inputs, S = 4096, H = 2:
rel-L2 against float64 attention with PV promoted every 4 key tiles and every 8 (shipped since 2026-12-05), for N(0,
1) inputs (near-uniform attention), sharper attention (q doubled, tripled), a channel offset on K, and attention
that follows the sequence (q and k a smooth walk along it, q tripled). Prints a Markdown table; about two minutes a
row.

    python notes/promote_accuracy.py [SEED]
"""

import sys

import torch

import openvc_kernels

S, H, D = 4096, 2, 128
CHAINS = (4, 8)


def exact(q, k, v):
    q, k, v = (x.double().transpose(1, 2) for x in (q, k, v))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2)


def rel_l2(a, b) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


def cases(generator: torch.Generator) -> dict:
    randn = lambda *shape: torch.randn(*shape, generator=generator)
    q, k, v = randn(1, S, H, D), randn(1, S, H, D), randn(1, S, H, D)
    walk = torch.cumsum(randn(1, S, H, D) * 0.3, dim=1)
    walk = (walk - walk.mean(1, keepdim=True)) / walk.std(1, keepdim=True)
    return {
        "N(0, 1)": (q, k, v),
        "q doubled": (2 * q, k, v),
        "q tripled": (3 * q, k, v),
        "K + 2 c (a channel offset)": (q, k + 2 * randn(1, 1, H, D), v),
        "q and k a walk along S, q tripled": (3 * (walk + 0.5 * randn(1, S, H, D)), walk + 0.5 * randn(1, S, H, D), v),
    }


def main() -> None:
    generator = torch.Generator().manual_seed(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    print("| inputs | " + " | ".join(f"every {n}" for n in CHAINS) + " | 8 over 4 |")
    print("|---|" + "---|" * (len(CHAINS) + 1))
    for name, inputs in cases(generator).items():
        q, k, v = (x.to(torch.bfloat16) for x in inputs)
        reference = exact(q, k, v)
        errors = [
            rel_l2(openvc_kernels.reference_attention(
                q, k, v, smooth_k=True, repair_ratio=0.005, accumulation="wgmma", promote_every=n
            ), reference)
            for n in CHAINS
        ]
        print(f"| {name} | " + " | ".join(f"{100 * e:.3f}%" for e in errors)
              + f" | {100 * (errors[1] / errors[0] - 1):+.2f}% |", flush=True)


if __name__ == "__main__":
    main()
