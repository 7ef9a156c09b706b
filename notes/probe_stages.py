"""Device probe: what limits the sm90 kernel, measured by leaving parts of the key-tile step out.

Each variant compiles the forward kernel with some steps of its softmax (``sm90.softmax.ExpCastSoftmax``) replaced
by no-ops (their results are then garbage; the tensor cores run at the same speed on any bytes) and times it on
prepared inputs, kernel only:

  default         the kernel as shipped
  no encode       encode skipped (no FFMA per score; the FP16 packing then packs the raw scores)
  no check        the packed codes' check skipped (no max of the halves, no vote; anchors never move)
  no encode/check online_codes and the check skipped (no anchor, no codes: the raw scores packed)

Leaving out the packing or the accumulation as well lets the compiler drop the wgmmas whose results then go
unused, so those variants would time nothing real.

Run on a Hopper GPU: ``python notes/probe_stages.py``. ``tests/test_probes.py`` compiles every variant on the CPU.
"""

import cutlass
import cutlass.cute as cute

import variant_runner
from openvc_kernels.ops import forward_args, prepare
from openvc_kernels.sm90.softmax import ExpCastSoftmax

SHAPES = ((32_760, 12), (75_600, 40))
TAU = 128**-0.5


class NoEncode(ExpCastSoftmax):
    @cute.jit
    def encode(self, coef):
        pass


class NoCheck(ExpCastSoftmax):
    @cute.jit
    def pack_codes_checked(self, frag_p, acc_pv):
        self.pack_codes(frag_p, False)


class NoEncodeOrCheck(NoCheck):
    @cute.jit
    def online_codes(self, has_padding, valid_keys, d_k, is_first: cutlass.Constexpr[bool]):
        pass


VARIANTS = {
    "default": ExpCastSoftmax, "no encode": NoEncode, "no check": NoCheck, "no encode/check": NoEncodeOrCheck,
}


def compile_variant(name: str):
    return variant_runner.compile_with_softmax(VARIANTS[name])


def main():
    import torch
    from triton.testing import do_bench

    print(torch.cuda.get_device_name(), flush=True)
    kernels = {name: compile_variant(name) for name in VARIANTS}
    for seq, heads in SHAPES:
        flop = 4 * seq * seq * heads * 128
        q, k, v = (torch.randn(1, seq, heads, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        p = prepare(q, k, v)
        out = torch.empty_like(q)
        args = forward_args(p, out, softmax_scale=TAU, window=4, split_tail=True)
        for name, kernel in kernels.items():
            call = lambda kernel=kernel: variant_runner.launch(kernel, args)  # noqa: E731
            ms = do_bench(call, warmup=100, rep=600, return_mode="median")
            print(f"{seq}x{heads} {name:>14}: {ms:8.2f} ms {flop / ms / 1e9:7.0f} TFLOP/s", flush=True)
        del q, k, v, p, out
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
