"""Device probe: what limits the sm90 kernel, measured by leaving parts of the key-tile step out.

Each variant compiles the forward kernel with some ``softmax`` functions replaced by no-ops (their results are
then garbage; the tensor cores run at the same speed on any bytes) and times it on prepared inputs, kernel only:

  default         the kernel as shipped
  no encode       encode skipped (no FFMA per score; the FP16 packing then packs the raw scores)
  no rescale      the accumulators never rescaled (alpha taken as 1; the promotion still runs)
  no max/encode   online_codes skipped (no row max, anchor or codes; alpha = 1)

Leaving out the packing or the accumulation as well lets the compiler drop the wgmmas whose results then go
unused, so those variants would time nothing real.

Run on a Hopper GPU: ``python notes/probe_stages.py``.
"""

import cutlass
import cutlass.cute as cute
import torch
from triton.testing import do_bench

from openvc_kernels.expcast import CODES_PER_NAT
from openvc_kernels.ops import compile_attention, prepare
from openvc_kernels.sm90 import softmax

SHAPES = ((32_760, 12), (75_600, 40))
TAU = 128**-0.5


@cute.jit
def _alpha_one(scores, key_coords, has_padding, valid_keys, m, anchor, alpha, s, d_k, is_first: cutlass.Constexpr):
    alpha.fill(1.0)


@cute.jit
def _skip_encode(scores, anchor, coef):
    pass


@cute.jit
def _promote_only(acc_o, acc_pv, alpha, pending, promote: cutlass.Boolean):
    if promote:
        for i in cutlass.range_constexpr(cute.size(acc_o)):
            acc_o[i] = acc_o[i] + acc_pv[i]


VARIANTS = {
    "default": {},
    "no encode": {"encode": _skip_encode},
    "no rescale": {"accumulate": _promote_only},
    "no max/encode": {"online_codes": _alpha_one},
}


def compile_variant(replacements: dict):
    originals = {name: getattr(softmax, name) for name in replacements}
    for name, fn in replacements.items():
        setattr(softmax, name, fn)
    try:
        return compile_attention(False)
    finally:
        for name, fn in originals.items():
            setattr(softmax, name, fn)


def main():
    print(torch.cuda.get_device_name(), flush=True)
    kernels = {name: compile_variant(replacements) for name, replacements in VARIANTS.items()}
    codes_per_score = float(torch.tensor(TAU * CODES_PER_NAT, dtype=torch.float32))
    for seq, heads in SHAPES:
        flop = 4 * seq * seq * heads * 128
        q, k, v = (torch.randn(1, seq, heads, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        p = prepare(q, k, v)
        out = torch.empty_like(q)
        args = (p.q8, p.k8, p.v_packed, p.d_q, p.d_k, p.d_v, p.d_v[..., None], out, codes_per_score, p.seqlen_k, 4, 0)
        for name, kernel in kernels.items():
            ms = do_bench(lambda kernel=kernel: kernel(*args), warmup=100, rep=600, return_mode="median")
            print(f"{seq}x{heads} {name:>14}: {ms:8.2f} ms {flop / ms / 1e9:7.0f} TFLOP/s", flush=True)
        del q, k, v, p, out
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
