"""Device probe: kernel-only time of variants (tuning knobs, the tail split), and FA4 BF16, at three bench shapes."""

import torch
from triton.testing import do_bench

from openvc_kernels.ops import attention_prepared, prepare

VARIANTS = {
    "default (tail split)": dict(),
    "no tail split": dict(split_tail=False),
}


def rotating(fn, inputs) -> float:
    """Median ms of ``fn(*inputs[k])`` with k cycling, so no input set stays in L2."""
    turn = iter(range(10**9))
    return do_bench(lambda: fn(*inputs[next(turn) % len(inputs)]), warmup=100, rep=600, return_mode="median")


def probe_shape(seq: int, heads: int, flash_attn_func) -> None:
    flop = 4 * seq * seq * heads * 128
    sets = [[torch.randn(1, seq, heads, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3)] for _ in range(2)]
    prepared = [[prepare(*s)] for s in sets]
    out = torch.empty_like(sets[0][0])
    for name, config in VARIANTS.items():
        ms = rotating(lambda p, c=config: attention_prepared(p, out, softmax_scale=128**-0.5, **c), prepared)
        print(f"{seq}x{heads} {name:>20}: {ms:8.2f} ms {flop / ms / 1e9:7.0f} TFLOP/s")
    ms = rotating(flash_attn_func, sets)
    print(f"{seq}x{heads} {'FA4 bf16':>20}: {ms:8.2f} ms {flop / ms / 1e9:7.0f} TFLOP/s")


def main():
    from flash_attn.cute import flash_attn_func

    print(torch.cuda.get_device_name())
    for seq, heads in ((73397, 7), (32760, 12), (75600, 40)):
        probe_shape(seq, heads, flash_attn_func)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
