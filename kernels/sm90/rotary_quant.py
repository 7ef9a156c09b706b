"""Q and K rotated by a rotary position embedding and quantized per 128-token block in one pass: the bytes of
``prep.QuantizePerBlock`` on ``rotary.RotaryQK``'s outputs, without the rotated Q and K ever reaching global memory.
Device code only: ``prep_ops`` compiles it and runs it on torch tensors.

  RotaryQuantizeQK  q, k (B, S, H, 128) fp16/bf16, cos, sin (S, 128) fp32[, mean (B, H, 128) fp32]
                    -> q8, k8 (B, H, S_pad, 128) E4M3, d_q, d_k (B, H, n_blocks)

Per head and block: rotate (``rotary.rotate_fragment``), round to the input dtype (what ``RotaryQK`` stores), then
as ``QuantizePerBlock``: K minus its channel mean (K smoothing), the block's absmax, scale, E4M3.

A CTA owns one 128-token block of one batch row and walks the heads g, g + G, ... (grid (n_blocks, G, B);
``prep_ops.head_groups`` picks G). It reads the block's angles once and keeps each thread's 64 in shared memory
(``ANGLE_STASH_SHAPE``), not in registers: a thread reads back only what it wrote, so no barrier guards them, and
the registers (which set how many CTAs share an SM) stay with the blocks. Threads hold tokens as the preparation's
kernels do (``prep.token_major_copy``). It starts beside the launch before it (``dependent_launch``): it reads
q, k, the tables and K's mean, which a launch before that one wrote.
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ..quant import BLOCK, MEAN_TOKEN_STRIDE
from .dependent_launch import complete_after_previous_launch, launch_options, start_beside_previous_launch
from .prep import (
    THREADS, TOKENS_PER_PASS, WARPS, AbsmaxAndChannelSums, block_coords, load_block, minus_channel_mean,
    store_quantized_block,
)
from .rotary import PAIRS_PER_THREAD, load_angles, rotate_fragment

PASSES = BLOCK // TOKENS_PER_PASS
"""A thread's tokens in a block (``TOKENS_PER_PASS`` apart)."""
ANGLE_STASH_SHAPE = (PAIRS_PER_THREAD, PASSES, THREADS)
ANGLE_STASH_STRIDE = (PASSES * THREADS, THREADS, 1)
"""sCos, sSin: (pair j, pass p, thread t) FP32, thread fastest: a warp's read of one (j, p) takes 32 consecutive
words, one per bank. 32 KiB each."""


@cute.jit
def _rotated_and_rounded(x: cute.Tensor, cos: cute.Tensor, sin: cute.Tensor) -> cute.TensorSSA:
    """This thread's values of a block (``load_block``'s fragment) rotated and rounded to their dtype, as FP32."""
    return rotate_fragment(x, cos, sin).load().to(x.element_type).to(Float32)


class RotaryQuantizeQK:
    """Rotate Q and K, then quantize each per block, K minus its channel mean where ``mMean`` is given (the module
    docstring). Grid (n_blocks, G, B)."""

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mCos: cute.Tensor,
        mSin: cute.Tensor,
        mQ8: cute.Tensor,
        mDq: cute.Tensor,
        mK8: cute.Tensor,
        mDk: cute.Tensor,
        mMean: cute.Tensor | None,
        head_groups: Int32,
        stream: cuda.CUstream,
    ):
        """mQ, mK (B, S, H, 128) fp16/bf16 of one shape; mCos, mSin (S, 128) fp32; mQ8, mK8 (B, H, S_pad, 128)
        uint8, rows contiguous; mDq, mDk (B, H, n_blocks) fp32; mMean (B, H, 128) fp32 or None; ``head_groups``
        G >= 1."""
        self.kernel(mQ, mK, mCos, mSin, mQ8, mDq, mK8, mDk, mMean, head_groups).launch(
            grid=[mDq.shape[2], head_groups, mDq.shape[0]], block=[THREADS, 1, 1], stream=stream,
            **launch_options(),
        )

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mCos: cute.Tensor,
        mSin: cute.Tensor,
        mQ8: cute.Tensor,
        mDq: cute.Tensor,
        mK8: cute.Tensor,
        mDk: cute.Tensor,
        mMean: cute.Tensor | None,
        groups: Int32,
    ):
        start_beside_previous_launch()
        tidx, _, _ = cute.arch.thread_idx()
        n, g, b = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        angle_stash = cute.make_layout(ANGLE_STASH_SHAPE, stride=ANGLE_STASH_STRIDE)
        s_cos = smem.allocate_tensor(Float32, angle_stash)
        s_sin = smem.allocate_tensor(Float32, angle_stash)
        # Q's and K's absmax alternate between two buffers: a warp that writes one for the next head has passed the
        # other's barrier, which every warp reaches only after reading this one.
        q_reduction = smem.allocate_tensor(Float32, cute.make_layout(WARPS))
        k_reduction = smem.allocate_tensor(Float32, cute.make_layout(WARPS))

        coords = block_coords(mQ, n, tidx)
        cos, sin = load_angles(mCos, mSin, coords)
        my_cos, my_sin = s_cos[None, None, tidx], s_sin[None, None, tidx]
        for p in cutlass.range_constexpr(PASSES):
            for j in cutlass.range_constexpr(PAIRS_PER_THREAD):
                my_cos[j, p] = cos[j, p]
                my_sin[j, p] = sin[j, p]

        for h in cutlass.range(g, mQ.shape[2], groups):
            # K's block loads before Q's barrier: both blocks' loads in flight at once.
            q_block, k_block = load_block(mQ, b, h, n, tidx), load_block(mK, b, h, n, tidx)
            store_quantized_block(_rotated_and_rounded(q_block, my_cos, my_sin), mQ8, mDq, b, h, n, q_reduction)
            k = _rotated_and_rounded(k_block, my_cos, my_sin)
            if cutlass.const_expr(mMean is not None):
                k = minus_channel_mean(k, mMean[b, h, None], coords, mK.shape[1])
            store_quantized_block(k, mK8, mDk, b, h, n, k_reduction)

        last_cta = (n == mDq.shape[2] - 1) & (g == groups - 1) & (b == mDq.shape[0] - 1)
        complete_after_previous_launch(last_cta)


class AbsmaxAndRotatedChannelSums(AbsmaxAndChannelSums):
    """``prep.AbsmaxAndChannelSums`` with K's block sums taken of the rotated keys (rotated and rounded as
    ``RotaryQuantizeQK`` rotates them): K smoothing's first pass where the rotation happens inside the preparation.
    Only the threads holding every ``MEAN_TOKEN_STRIDE``-th key load angles."""

    @cute.jit
    def summed_values(
        self, k_block: cute.Tensor, coords: cute.Tensor, mCos: cute.Tensor | None, mSin: cute.Tensor | None
    ) -> cute.TensorSSA:
        cos, sin = load_angles(mCos, mSin, coords, MEAN_TOKEN_STRIDE)
        return _rotated_and_rounded(k_block, cos, sin)
