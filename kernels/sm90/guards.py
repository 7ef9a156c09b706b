"""The descale guards (``quant.apply_descale_guards``) in one launch, in place on the preparation's descales: d_q
``quant.limit_code_span`` and d_v ``quant.poison_non_finite``. Device code only: ``prep_ops`` compiles it and runs it
after the preparation's launches (``sm90.prep``), on the same stream.

Writes the bytes that torch's CUDA ops write for ``apply_descale_guards``, non-finite values included:

  d_k_max = amax(d_k[b, h, :])                            a NaN of d_k (its bits) if any is NaN, as torch's amax
  bound   = mul.rn(div.rn(1, d_k_max), numerator)         ``reciprocal(d_k_max) * quant.code_span_numerator``:
                                                          an IEEE reciprocal, then one product (two roundings)
  d_q'    = d_q if d_q is NaN, else bound if bound is NaN, else min.f32(d_q, bound)     torch.minimum on CUDA
  d_v'    = NaN (0x7fc00000, masked_fill's float32(nan)) if any of the head's d_q, d_k, d_v is inf or NaN, else d_v

``numerator`` is a runtime FP32 argument (it depends on the softmax scale), so one compiled kernel serves every
call; the kernel does not read the attention inputs, so it does not depend on their dtype either.
NaN and inf tests work on the bits (an FP32 is finite iff its exponent bits are not all ones), so no compiler
assumption about non-finite floats can change them.

Grid (H, B): one CTA per (b, h), 128 threads (4 warps). Descales (B, H, n) fp32, compact row-major (the buffers of
``prep_ops.empty_prepared``), n_q and n_k any size (a thread loops over every 128th block: S = 128k tokens is 1000):

  1. Reads: thread t takes d_k[t], d_k[t + 128], ... (their NaN-propagating max and their exponent bits' max) and
     d_q[t], d_q[t + 128], ... (exponent bits only).
  2. Block reduction: a butterfly in each warp, one value per warp in shared memory, one bar.sync; every thread
     then combines the 4 warps' values: the head's d_k_max, and whether some d_q or d_k is not finite.
  3. Writes: each thread rewrites the d_q entries it read in 1 (no thread reads what another writes, and the reads of
     1 are all before the barrier); thread 0 reads d_v and poisons it where the head is not finite.
"""

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32

from .dependent_launch import follow_previous_launch, launch_options
from .float_bits import EXPONENT_BITS, MAGNITUDE_BITS
from .ptx import mul_rn

THREADS = 128
WARPS = THREADS // 32
POISON_BITS = 0x7FC00000
"""The NaN ``poison_non_finite`` writes: ``masked_fill(math.nan)`` fills with float32(nan), the default quiet NaN."""


@cute.jit
def _exponent(x: Float32) -> Int32:
    """x's exponent bits in place: ``EXPONENT_BITS`` iff x is inf or NaN. The max over values is that iff some is."""
    return x.bitcast(Int32) & EXPONENT_BITS


@cute.jit
def _is_nan(x: Float32) -> Boolean:
    return (x.bitcast(Int32) & MAGNITUDE_BITS) > EXPONENT_BITS


@cute.jit
def _amax_step(a: Float32, b: Float32) -> Float32:
    """One step of torch's CUDA amax (``MaxNanFunctor``): ``a`` where it is NaN, else ``b`` where it is NaN (the NaN
    itself, its bits kept, where max.NaN would give the canonical one), else their max. With one NaN bit pattern in
    a head (every NaN a quantization writes) the result is torch's in any order."""
    larger = Float32(cutlass.select_(_is_nan(b), b, cute.arch.fmax(a, b)))
    return Float32(cutlass.select_(_is_nan(a), a, larger))


@cute.jit
def _minimum(a: Float32, b: Float32) -> Float32:
    """``torch.minimum`` as CUDA computes it: ``a`` where it is NaN (its bits), else ``b`` where it is NaN, else
    ``::min(a, b)`` (min.f32, which alone would return the other operand of a NaN)."""
    lowered = Float32(cutlass.select_(_is_nan(b), b, cute.arch.fmin(a, b)))
    return Float32(cutlass.select_(_is_nan(a), a, lowered))


def _max_int(a: Int32, b: Int32) -> Int32:
    return cutlass.max(a, b)


class DescaleGuards:
    """``quant.apply_descale_guards`` in place: d_q lowered by the code span limit, d_v NaN for a non-finite head."""

    @cute.jit
    def __call__(self, mDq: cute.Tensor, mDk: cute.Tensor, mDv: cute.Tensor, numerator: Float32,
                 stream: cuda.CUstream):
        """mDq (B, H, n_q), mDk (B, H, n_k), mDv (B, H) fp32, as quantization wrote them; d_q and d_v are rewritten.
        ``numerator``: ``quant.code_span_numerator(softmax_scale, head_dim)``."""
        self.kernel(mDq, mDk, mDv, numerator).launch(
            grid=[mDq.shape[1], mDq.shape[0], 1], block=[THREADS, 1, 1], stream=stream,
            **launch_options(),
        )

    @cute.kernel
    def kernel(self, mDq: cute.Tensor, mDk: cute.Tensor, mDv: cute.Tensor, numerator: Float32):
        follow_previous_launch()
        tidx, _, _ = cute.arch.thread_idx()
        h, b, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        max_buffer = smem.allocate_tensor(Float32, cute.make_layout(WARPS))
        exponent_buffer = smem.allocate_tensor(Int32, cute.make_layout(WARPS))
        d_q, d_k = mDq[b, h, None], mDk[b, h, None]

        # 1. Reads. -inf is the max's identity (amax over at least one block).
        d_k_max = Float32(-math.inf)
        exponent = Int32(0)
        for i in cutlass.range(tidx, cute.size(d_k), THREADS):
            x = d_k[i]
            d_k_max = _amax_step(d_k_max, x)
            exponent = _max_int(exponent, _exponent(x))
        for i in cutlass.range(tidx, cute.size(d_q), THREADS):
            exponent = _max_int(exponent, _exponent(d_q[i]))

        # 2. Block reduction. warp_idx() runs with the warp converged (see sm90.prep._block_absmax).
        d_k_max = cute.arch.warp_reduction(d_k_max, _amax_step)
        exponent = cute.arch.warp_reduction(exponent, _max_int)
        lane, warp = cute.arch.lane_idx(), cute.arch.warp_idx()
        if lane == 0:
            max_buffer[warp] = d_k_max
            exponent_buffer[warp] = exponent
        cute.arch.barrier()
        d_k_max, exponent = max_buffer[0], exponent_buffer[0]
        for w in cutlass.range_constexpr(1, WARPS):
            d_k_max = _amax_step(d_k_max, max_buffer[w])
            exponent = _max_int(exponent, exponent_buffer[w])

        # 3. Writes: the bound rounded twice, as torch's reciprocal and product round it.
        bound = mul_rn(Float32(1.0) / d_k_max, numerator)
        for i in cutlass.range(tidx, cute.size(d_q), THREADS):
            d_q[i] = _minimum(d_q[i], bound)
        if tidx == 0:
            exponent = _max_int(exponent, _exponent(mDv[b, h]))
            if exponent == EXPONENT_BITS:
                mDv[b, h] = Int32(POISON_BITS).bitcast(Float32)
