"""Device probe: ways to reduce K's per-channel mean over the sequence (K smoothing), timed alone at the bench shapes.

``prep_ops.channel_mean`` is the preparation's own: two launches (per-block sums, then the blocks in eight
segments), the order ``quant.channel_mean`` spells out. The others read the same bytes: torch's one reduction,
``k.transpose(1, 2).mean(dim=2, dtype=float32)`` (the mean until 2026-12-01), ``fold`` consecutive tokens summed side
by side (one reduction to (B, fold H D), then one over the fold, then the ``S % fold`` last tokens; fold 1 is one
sum over the sequence, then a division), and a ones-row GEMM with FP32 output (cuBLAS). Prints each one's median
time (do_bench: back to back), its bandwidth and its largest difference from the float64 mean.
"""

import torch
from triton.testing import do_bench

from openvc_kernels import prep_ops

SHAPES = ((32760, 12), (73397, 7), (75600, 40), (118800, 24))
FOLDS = (1, 2, 4, 8, 16)


def folded_mean(k: torch.Tensor, fold: int) -> torch.Tensor:
    b, s, h, d = k.shape
    whole = s - s % fold
    sums = k[:, :whole].reshape(b, whole // fold, fold * h * d).sum(dim=1, dtype=torch.float32)
    sums = sums.view(b, fold, h, d).sum(dim=1)
    if whole < s:
        sums += k[:, whole:].sum(dim=1, dtype=torch.float32)
    return sums / s


def ones_row_mean(k: torch.Tensor) -> torch.Tensor:
    b, s, h, d = k.shape
    ones = torch.ones(b, 1, s, dtype=k.dtype, device=k.device)
    return torch.bmm(ones, k.view(b, s, h * d), out_dtype=torch.float32).div_(s).view(b, h, d)


def ways() -> dict:
    return {
        "prep_ops.channel_mean": prep_ops.channel_mean,
        "torch mean": lambda k: k.transpose(1, 2).mean(dim=2, dtype=torch.float32),
        **{f"fold {fold}": lambda k, fold=fold: folded_mean(k, fold) for fold in FOLDS},
        "ones-row bmm, FP32 out": ones_row_mean,
    }


def main():
    print(torch.cuda.get_device_name())
    for seq, heads in SHAPES:
        k = torch.randn(1, seq, heads, 128, device="cuda", dtype=torch.bfloat16) + 0.5
        exact = k.double().mean(dim=1).flatten()
        for name, fn in ways().items():
            ms = do_bench(lambda: fn(k), warmup=50, rep=300, return_mode="median")
            error = (fn(k).double().flatten() - exact).abs().max().item()
            tb_per_s = k.numel() * 2 / ms / 1e9
            print(f"{seq}x{heads} {name:24s} {ms * 1e3:7.1f} us {tb_per_s:6.2f} TB/s  max error {error:.1e}")


if __name__ == "__main__":
    main()
