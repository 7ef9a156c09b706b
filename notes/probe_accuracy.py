"""Device probe: where the sm90 kernel's differences from the reference come from.

Kernel vs reference on random inputs, and on inputs whose Q8.K8 dot products are exact at any
   accumulation precision (8 channels of +-1): there codes must agree, so the error is FP32 order only.
"""

import torch

from openvc_kernels.ops import attention_prepared, prepare
from openvc_kernels.reference import reference_attention


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def exact_inputs(seq, heads):
    def sparse():
        x = torch.zeros(1, seq, heads, 128, device="cuda")
        x[..., :8] = torch.randint(-1, 2, (1, seq, heads, 8), device="cuda").float()
        x[:, ::64, :, 0] = 1.0  # every 128-token block has absmax 1
        return x.bfloat16()

    return sparse(), sparse(), torch.randn(1, seq, heads, 128, device="cuda", dtype=torch.bfloat16)


def main():
    print(f"{'case':>30} {'rel-L2':>9} {'bf16 diff frac':>14}")
    for kind, config in (("random", {}), ("exact-raw", {}), ("exact-raw promote1", dict(promote_every=1))):
        for seq, heads in ((127, 1), (128, 12), (1000, 4), (4096, 12), (32760, 12)):
            if kind == "random":
                q, k, v = (torch.randn(1, seq, heads, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            else:
                q, k, v = exact_inputs(seq, heads)
            out = torch.full_like(q, float("nan"))
            attention_prepared(prepare(q, k, v), out, softmax_scale=128**-0.5, **config)
            ref = reference_attention(q, k, v)
            frac = (out != ref).float().mean().item()
            print(f"{kind + ' ' + str(seq) + 'x' + str(heads):>30} {rel(out, ref):9.2e} {frac:14.4f}")


if __name__ == "__main__":
    main()
