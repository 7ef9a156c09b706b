"""Device probe: the defaults' two slower preparation launches at three CTAs per SM instead of two.

Packed V with the residual energies (``pack_v_energy``) and K's quantization minus its channel mean
(``quantize_centered_per_block``) use more registers than their plain kinds, so fewer of their 256-thread CTAs fit
an SM (the counts: notes/kernel.md, 2026-12-02 15:10). Each is compiled once more with
``min_blocks_per_mp=CTAS_PER_SM`` (ptxas then keeps it to the registers that many CTAs leave, spilling what does not
fit). Both builds of each kind must write the same bytes (checked first); then each pair is timed back to back,
interleaved call by call (``bench_attention.time_interleaved``). Prints each one's median us and the bounded one's time
over the shipped one's (the median over rounds of the ratio within a round).
"""

import os
import statistics
import sys

import cutlass.cute as cute
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from bench_attention import median_over, time_interleaved  # noqa: E402

from openvc_kernels import prep_ops  # noqa: E402
from openvc_kernels.quant import BLOCK, num_blocks  # noqa: E402
from openvc_kernels.sm90 import prep  # noqa: E402
from openvc_kernels.sm90.layout import HEAD_DIM, PV_N  # noqa: E402

SHAPES = ((32760, 12), (73397, 7))
CTAS_PER_SM = 3
BUDGET_MS = 3000


class BoundedPackV(prep.PackV):
    @cute.jit
    def __call__(self, mV, mAmax, mVp, mDv, mEnergy, stream):
        n_blocks = cute.ceil_div(mV.shape[1], prep.BLOCK)
        self.kernel(mV, mAmax, mVp, mDv, mEnergy).launch(
            grid=[n_blocks, mV.shape[2], mV.shape[0]], block=[prep.THREADS, 1, 1], stream=stream,
            min_blocks_per_mp=CTAS_PER_SM, preferred_smem_carveout=-1,
        )


class BoundedQuantizePerBlock(prep.QuantizePerBlock):
    @cute.jit
    def __call__(self, mX, mX8, mD, mMean, stream):
        self.kernel(mX, mX8, mD, mMean).launch(
            grid=[mD.shape[2], mD.shape[1], mD.shape[0]], block=[prep.THREADS, 1, 1], stream=stream,
            min_blocks_per_mp=CTAS_PER_SM, preferred_smem_carveout=-1,
        )


VARIANTS = {
    "pack_v_energy": ("PackV", BoundedPackV),
    "quantize_centered_per_block": ("QuantizePerBlock", BoundedQuantizePerBlock),
}
"""The kinds timed bounded: ``prep_ops``' name of the shipped class, and the bounded class."""
DTYPE = torch.bfloat16


def compile_variant(kind: str):
    """``prep_ops.compile_prep(kind, DTYPE)`` with the bounded class in place of the shipped one."""
    name, bounded = VARIANTS[kind]
    shipped = getattr(prep_ops, name)
    setattr(prep_ops, name, bounded)
    try:
        return prep_ops.compile_prep(kind, DTYPE)
    finally:
        setattr(prep_ops, name, shipped)


def report(label: str, times: list[list[float]]) -> None:
    shipped, bounded = times
    print(
        f"  {label:30s} shipped {1e3 * statistics.median(shipped):7.1f} us, {CTAS_PER_SM} CTAs/SM "
        f"{1e3 * statistics.median(bounded):7.1f} us: {100 * median_over(bounded, shipped):+6.2f}%",
        flush=True,
    )


def main():
    torch.manual_seed(0)
    kernels = {kind: (prep_ops.load_prep(kind, DTYPE), compile_variant(kind)) for kind in VARIANTS}
    for seq, heads in SHAPES:
        print(f"S={seq} H={heads}")
        v, k = (torch.randn(1, seq, heads, HEAD_DIM, device="cuda", dtype=DTYPE) + 3 for _ in range(2))
        s_pad, n_k = num_blocks(seq) * BLOCK, num_blocks(seq)
        amax = v.float().abs().amax(dim=(1, 3))
        mean = prep_ops.channel_mean(k)
        outputs = []
        for pack in kernels["pack_v_energy"]:
            packed = torch.full((1, heads, PV_N, s_pad), 0x7F, dtype=torch.uint8, device="cuda")
            d_v, energy = (torch.full(shape, float("nan"), device="cuda") for shape in ((1, heads), (1, heads, seq)))
            pack(v, amax, packed, d_v, energy)
            outputs.append((packed, d_v.view(torch.int32), energy.view(torch.int32)))
        for quantize in kernels["quantize_centered_per_block"]:
            k8 = torch.full((1, heads, s_pad, HEAD_DIM), 0x7F, dtype=torch.uint8, device="cuda")
            d_k = torch.full((1, heads, n_k), float("nan"), device="cuda")
            quantize(k, k8, d_k, mean)
            outputs.append((k8, d_k.view(torch.int32)))
        same = [all(torch.equal(a, b) for a, b in zip(outputs[i], outputs[i + 1])) for i in (0, 2)]
        print(f"  the same bytes: pack_v_energy {same[0]}, quantize_centered_per_block {same[1]}", flush=True)
        (packed, d_v, energy), (k8, d_k) = outputs[0], outputs[2]
        d_v, energy, d_k = d_v.view(torch.float32), energy.view(torch.float32), d_k.view(torch.float32)
        calls = [lambda i, f=f: f(v, amax, packed, d_v, energy) for f in kernels["pack_v_energy"]]
        report("pack_v_energy", time_interleaved(calls, [[0], [1]], "back_to_back", BUDGET_MS))
        calls = [lambda i, f=f: f(k, k8, d_k, mean) for f in kernels["quantize_centered_per_block"]]
        report("quantize_centered_per_block", time_interleaved(calls, [[0], [1]], "back_to_back", BUDGET_MS))


if __name__ == "__main__":
    main()
