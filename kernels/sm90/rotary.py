"""Q and K rotated by a rotary position embedding in one pass, with the roundings of diffusers' Wan attention
(``rotary.rotary_reference``, bit for bit). Device code only: ``rotary`` compiles it and runs it on torch tensors.

Channels pair up as (2 i, 2 i + 1) = (x1, x2); each token's FP32 tables give cos on the even channel of a pair and
sin on the odd one:

  out[2 i]     = x1 * cos[2 i] - x2 * sin[2 i + 1]
  out[2 i + 1] = x1 * sin[2 i + 1] + x2 * cos[2 i]

each product rounded to FP32 on its own (``mul.rn``: torch's multiplications are kernels of their own, so an FMA
would round differently), the sum or difference in FP32, then one RNE rounding to the input's dtype.

  RotaryQK  q, k (B, S, H, 128) fp16/bf16, cos, sin (S, 128) fp32 -> q_out, k_out (B, S, H, 128)

A CTA owns one 128-token block of one batch row and walks its heads: it reads the block's angles once (the tables
are per token, the same for every head), then each head's Q and K block once. Threads hold tokens as the
preparation's kernels do (``prep.token_major_copy``: 16 consecutive channels of 4 tokens), so a thread's 8 pairs
never leave its registers.
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ..quant import BLOCK
from .dependent_launch import follow_previous_launch, launch_options
from .layout import HEAD_DIM
from .prep import CHANNELS_PER_THREAD, THREADS, block_coords, load_block, token_major_copy
from .ptx import mul_rn

PAIRS_PER_THREAD = CHANNELS_PER_THREAD // 2
"""A thread's channel pairs per token: its 16 channels start at a multiple of 16, so no pair straddles threads."""


@cute.jit
def load_angles(
    mCos: cute.Tensor, mSin: cute.Tensor, coords: cute.Tensor, token_stride: cutlass.Constexpr[int] = 1
) -> tuple[cute.Tensor, cute.Tensor]:
    """cos of the even channel and sin of the odd channel of each of this thread's pairs, per pass:
    (PAIRS_PER_THREAD, passes) FP32 each, 0 for tokens past S, and for tokens that are not a multiple of
    ``token_stride`` (those ``prep.load_block`` leaves unloaded with the same stride). ``coords``:
    ``prep.block_coords``."""
    passes = cute.size(coords, mode=[1])
    cos = cute.make_rmem_tensor((PAIRS_PER_THREAD, passes), Float32)
    sin = cute.make_rmem_tensor((PAIRS_PER_THREAD, passes), Float32)
    cos.fill(0.0)
    sin.fill(0.0)
    for p in cutlass.range_constexpr(passes):
        token = coords[0, p, 0][0]
        if token < mCos.shape[0] and token % token_stride == 0:
            for j in cutlass.range_constexpr(PAIRS_PER_THREAD):
                channel = coords[2 * j, p, 0][1]
                cos[j, p] = mCos[token, channel]
                sin[j, p] = mSin[token, channel + 1]
    return cos, sin


@cute.jit
def rotate_fragment(x_in: cute.Tensor, cos: cute.Tensor, sin: cute.Tensor) -> cute.Tensor:
    """This thread's values of a block (``load_block``'s fragment) rotated, in FP32 (not yet rounded to the input
    dtype): the module docstring's arithmetic. ``cos``, ``sin``: (PAIRS_PER_THREAD, passes) as ``load_angles``
    returns them, in registers or in shared memory."""
    x = cute.make_rmem_tensor(x_in.shape, Float32)
    x.store(x_in.load().to(Float32))
    rotated = cute.make_rmem_tensor(x_in.shape, Float32)
    for p in cutlass.range_constexpr(cute.size(x, mode=[1])):
        for j in cutlass.range_constexpr(PAIRS_PER_THREAD):
            x1, x2 = x[2 * j, p, 0], x[2 * j + 1, p, 0]
            rotated[2 * j, p, 0] = mul_rn(x1, cos[j, p]) - mul_rn(x2, sin[j, p])
            rotated[2 * j + 1, p, 0] = mul_rn(x1, sin[j, p]) + mul_rn(x2, cos[j, p])
    return rotated


@cute.jit
def rotate_block(
    mX: cute.Tensor, mOut: cute.Tensor, cos: cute.Tensor, sin: cute.Tensor, b: Int32, h: Int32, n: Int32
):
    """Block n of ``mX`` (B, S, H, 128) at (b, h), rotated, into the same block of ``mOut``; tokens past S are
    neither read nor written."""
    tidx, _, _ = cute.arch.thread_idx()
    coords = block_coords(mX, n, tidx)
    rotated = rotate_fragment(load_block(mX, b, h, n, tidx), cos, sin)
    tiled_copy = token_major_copy(mOut.element_type)
    gOut = cute.local_tile(mOut[b, None, h, None], (BLOCK, HEAD_DIM), (n, 0))
    tOgOut = tiled_copy.get_slice(tidx).partition_D(gOut)
    tOrOut = cute.make_rmem_tensor_like(tOgOut)
    tOrOut.store(rotated.load().to(mOut.element_type))
    for p in cutlass.range_constexpr(cute.size(tOgOut, mode=[1])):
        if coords[0, p, 0][0] < mX.shape[1]:
            cute.copy(tiled_copy, tOrOut[None, p, None], tOgOut[None, p, None])


class RotaryQK:
    """Q and K rotated (the module docstring's arithmetic). Grid (n_blocks, B), each CTA over every head."""

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mCos: cute.Tensor,
        mSin: cute.Tensor,
        mQOut: cute.Tensor,
        mKOut: cute.Tensor,
        stream: cuda.CUstream,
    ):
        """mQ, mK, mQOut, mKOut (B, S, H, 128) fp16/bf16, all of one shape; mCos, mSin (S, 128) fp32."""
        n_blocks = cute.ceil_div(mQ.shape[1], BLOCK)
        self.kernel(mQ, mK, mCos, mSin, mQOut, mKOut).launch(
            grid=[n_blocks, mQ.shape[0], 1], block=[THREADS, 1, 1], stream=stream,
            **launch_options(),
        )

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mCos: cute.Tensor,
        mSin: cute.Tensor,
        mQOut: cute.Tensor,
        mKOut: cute.Tensor,
    ):
        follow_previous_launch()
        tidx, _, _ = cute.arch.thread_idx()
        n, b, _ = cute.arch.block_idx()
        cos, sin = load_angles(mCos, mSin, block_coords(mQ, n, tidx))
        for h in cutlass.range(mQ.shape[2]):
            rotate_block(mQ, mQOut, cos, sin, b, h, n)
            rotate_block(mK, mKOut, cos, sin, b, h, n)
