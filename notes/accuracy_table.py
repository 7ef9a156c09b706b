"""Accuracy of V repair (both rankings) and K smoothing with the reference on the CPU.

rel-L2 against float64 attention, S = 4096, H = 2; prints the Markdown tables of notes/accuracy.md, the last one
K smoothing's mean of every 8th key (``quant.channel_mean``) against the mean of all keys (given as ``k_mean``).
"""

import torch, openvc_kernels as ok

S, H = 4096, 2


def exact(q, k, v):
    q, k, v = (x.double().transpose(1, 2) for x in (q, k, v))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2)


def rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


torch.manual_seed(0)
q, k, v = [torch.randn(1, S, H, 128) for _ in range(3)]
heavy = v * torch.exp(1.5 * torch.randn(1, S, H, 1))
outl = v.clone()
idx = torch.randperm(S)[: round(0.005 * S)]
outl[:, idx] *= 20
koff = k + torch.zeros(1, 1, H, 128).index_fill_(3, torch.arange(4), 20.0)
cases = {
    "N(0,1)": (q, k, v),
    "heavy-tailed V norms": (q, k, heavy),
    "0.5% V tokens x20": (q, k, outl),
    "K +20 on 4 channels": (q, koff, v),
}
rhos = (0, 0.0025, 0.005, 0.01, 0.02)
print("| inputs | smooth_k | " + " | ".join(f"rho={r}" for r in rhos) + " |")
print("|---|---|" + "---|" * len(rhos))
for name, (a, b, c) in cases.items():
    e = exact(a, b, c)
    for sm in (False, True):
        vals = [rel(ok.reference_attention(a, b, c, repair_ratio=r, smooth_k=sm), e) for r in rhos]
        print(f"| {name} | {sm} | " + " | ".join(f"{x * 100:.2f}%" for x in vals) + " |", flush=True)

# Repair ranking: residual energy alone vs energy times attention mass, on inputs where attention is uneven.
sinks_q, sinks_k = q + 0.5, k.clone()
sinks_k[:, torch.randperm(S)[:40]] += 2.0
base = torch.cumsum(torch.randn(1, S, H, 128) * 0.3, dim=1)
base = (base - base.mean(1, keepdim=True)) / base.std(1, keepdim=True)
local_q, local_k = 2.0 * base + 0.5 * torch.randn_like(base), base + 0.5 * torch.randn_like(base)
ranked = {
    "N(0,1), heavy-tailed V": (q, k, heavy),
    "sink keys, heavy-tailed V": (sinks_q, sinks_k, heavy),
    "local (video-like), heavy-tailed V": (local_q, local_k, heavy),
}


def table(header: str, cases: dict, errors, digits: int = 2) -> None:
    """One Markdown table: a row per case, ``errors(q, k, v)`` the outputs whose rel-L2 against float64 it prints."""
    print()
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for name, (a, b, c) in cases.items():
        e = exact(a, b, c)
        print(f"| {name} | " + " | ".join(f"{rel(out, e) * 100:.{digits}f}%" for out in errors(a, b, c)) + " |", flush=True)


table(
    "| inputs | rho=0 | energy, rho=0.005 | attention, rho=0.005 | energy, rho=0.02 | attention, rho=0.02 |",
    ranked,
    lambda a, b, c: [ok.reference_attention(a, b, c, repair_ratio=0)] + [
        ok.reference_attention(a, b, c, repair_ratio=r, repair_ranking=rk)
        for r in (0.005, 0.02) for rk in ("energy", "attention")
    ],
)

# K smoothing's mean: every 8th key (shipped) against all keys; drifting keys with an offset on every channel.
drifting_k = local_k + 3.0 * torch.randn(1, 1, H, 128)
means = {
    "N(0,1)": (q, k, v),
    "K +20 on 4 channels": (q, koff, v),
    "drifting K, offsets on every channel": (local_q, drifting_k, v),
}
table(
    "| inputs | no smoothing | mean of all keys | mean of every 8th key (shipped) |",
    means,
    lambda a, b, c: [
        ok.reference_attention(a, b, c),
        ok.reference_attention(a, b, c, smooth_k=True, k_mean=b.float().mean(dim=1)),
        ok.reference_attention(a, b, c, smooth_k=True),
    ],
    digits=3,
)
