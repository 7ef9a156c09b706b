"""Device probe: K's per-channel mean over the sequence (K smoothing), timed alone at the bench shapes.

``quant.channel_mean`` adds ``MEAN_FOLD`` consecutive tokens side by side; this times it at several folds (1: one
reduction over the sequence, as before 2026-12-01) and the former ``k.transpose(1, 2).mean(dim=2, dtype=float32)``.
Prints each one's median time, its bandwidth and its largest difference from the float64 mean.
"""

import torch
from triton.testing import do_bench

from openvc_kernels import quant

SHAPES = ((32760, 12), (73397, 7), (75600, 40), (118800, 24))
FOLDS = (1, 2, 4, 8, 16)


def folded(fold: int):
    def mean(k: torch.Tensor) -> torch.Tensor:
        quant.MEAN_FOLD = fold
        return quant.channel_mean(k)

    return mean


def ways() -> dict:
    former = {"former: mean over the transposed view": lambda k: k.transpose(1, 2).mean(dim=2, dtype=torch.float32)}
    return former | {f"channel_mean, fold {fold}": folded(fold) for fold in FOLDS}


def main():
    print(torch.cuda.get_device_name())
    for seq, heads in SHAPES:
        k = torch.randn(1, seq, heads, 128, device="cuda", dtype=torch.bfloat16) + 0.5
        exact = k.double().mean(dim=1).flatten()
        for name, fn in ways().items():
            ms = do_bench(lambda: fn(k), warmup=50, rep=300, return_mode="median")
            error = (fn(k).double().flatten() - exact).abs().max().item()
            tb_per_s = k.numel() * 2 / ms / 1e9
            print(f"{seq}x{heads} {name:40s} {ms * 1e3:7.1f} us {tb_per_s:6.2f} TB/s  max error {error:.1e}")


if __name__ == "__main__":
    main()
