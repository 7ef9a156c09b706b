"""Device probe: ways to reduce K's per-channel mean over the sequence (K smoothing), timed alone, at the bench shapes.

``quant.channel_mean`` today is ``k.transpose(1, 2).mean(dim=2, dtype=float32)``; the others read the same bytes:
a sum over diffusers' own (B, S, H * D) layout, and a ones-row GEMM with FP32 output (cuBLAS). Prints each one's
median time, its bandwidth and its largest difference from the float64 mean.
"""

import torch
from triton.testing import do_bench

SHAPES = ((32760, 12), (73397, 7), (75600, 40), (118800, 24))


def ways(k: torch.Tensor) -> dict:
    b, s, h, d = k.shape
    ones = torch.ones(b, 1, s, dtype=k.dtype, device=k.device)
    return {
        "mean over the transposed view": lambda: k.transpose(1, 2).mean(dim=2, dtype=torch.float32),
        "sum over (B, S, H*D), / S": lambda: k.view(b, s, h * d).sum(dim=1, dtype=torch.float32).div_(s),
        "ones-row bmm, FP32 out, / S": lambda: torch.bmm(ones, k.view(b, s, h * d), out_dtype=torch.float32).div_(s),
    }


def main():
    print(torch.cuda.get_device_name())
    for seq, heads in SHAPES:
        k = torch.randn(1, seq, heads, 128, device="cuda", dtype=torch.bfloat16) + 0.5
        exact = k.double().mean(dim=1).flatten()
        for name, fn in ways(k).items():
            ms = do_bench(fn, warmup=50, rep=300, return_mode="median")
            error = (fn().double().flatten() - exact).abs().max().item()
            tb_per_s = k.numel() * 2 / ms / 1e9
            print(f"{seq}x{heads} {name:32s} {ms * 1e3:7.1f} us {tb_per_s:6.2f} TB/s  max error {error:.1e}")


if __name__ == "__main__":
    main()
