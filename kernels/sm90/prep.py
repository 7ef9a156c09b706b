"""Fused preparation for the sm90 kernel: Q and K to FP8 per 128-token block, V to FP8 per head, packed. Device
code only: ``prep_ops`` compiles these kernels and runs them on torch tensors.

Byte-identical to ``quant.quantize_per_block`` (Q, K) and ``layout.pack_v(quant.quantize_per_head(V))``
(``preparation.prepare_reference``). With K smoothing, K's per-channel mean (``quant.channel_mean``, of every
``MEAN_TOKEN_STRIDE``-th key of the whole sequence, so two passes come first, in the reference's summation order;
the first shares V's absmax launch where both run) is subtracted inside the K launch.
Inputs are diffusers' ``(B, S, H, 128)`` fp16/bf16, any strides whose head-dim stride is 1 and the others
multiples of 8 elements (16 bytes); anything else is copied once by ``prep_ops.prepare``.

Four launches (five with K smoothing), stream-ordered and chained by programmatic dependent launch
(``dependent_launch``; Q's quantization starts beside the launch before it), no host synchronisation, capturable in a
CUDA graph (then the descale guards, ``quant.apply_descale_guards``, one launch of ``sm90.guards``), and with V
residual repair, after the tokens' choice (``repair.select_repair_tokens``, one launch of ``sm90.select``), one more:

  ChannelSumsPerBlock   k (B, S, H, 128)  -> sums (B, H, n_blocks, 128) fp32     (K smoothing only)
  AbsmaxAndChannelSums  v, k              -> AbsmaxPerHead's amax and ChannelSumsPerBlock's sums, one launch
  ChannelMean           sums              -> mean (B, H, 128) fp32                (K smoothing only)
  QuantizePerBlock (Q)  x (B, S, H, 128)  -> x8 (B, H, S_pad, 128) E4M3, d (B, H, n_blocks)
  QuantizePerBlock (K)  same, optionally minus the channel mean (B, H, 128)
  AbsmaxPerHead    (V)  v                 -> amax (B, H): atomic max of each block's absmax
  PackV            (V)  v, amax           -> v_packed (B, H, 136, S_pad) E4M3, d_v (B, H),
                                             optionally each token's residual energy (B, H, S) for repair
  RepairRows            v, amax, tokens (B, H, count), k8, d_k, d_v
                                          -> the R repair keys after the real ones in k8 and v_packed,
                                             d_k_repair (B, H, R), tile_repair (B, H, R)

The outputs may be views into larger buffers (their batch, head and row strides are free): with V residual
repair, k8 and v_packed have room for the repair keys after the real ones, which RepairRows writes as
``preparation.write_repair_rows`` does.

Every CTA (but ChannelMean's and RepairRows') owns one 128-token block of one (b, h): 256 threads, each holding
16 consecutive channels of 4 tokens in registers (the block is read once per kernel). V is read twice: its scale
needs the whole head.
The absmax is exact in any order (max of non-negative FP32s, and on their bits as integers), so the
atomics leave the result deterministic.
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint8

from ..quant import ABSMAX_FLOOR, BLOCK, FP8_MAX, MEAN_SEGMENTS, MEAN_TOKEN_STRIDE
from .dependent_launch import (
    complete_after_previous_launch, follow_previous_launch, launch_options, start_beside_previous_launch
)
from .layout import CHUNK, E4M3_ONE, HEAD_DIM, KEY_PERMUTATION, ONES_ROWS
from .ptx import mul_rn

THREADS = 256
WARPS = THREADS // 32
CHANNELS_PER_THREAD = 16
"""Consecutive channels of one token per thread: two 16-byte loads in, one 16-byte FP8 store out."""
THREADS_PER_TOKEN = HEAD_DIM // CHANNELS_PER_THREAD
TOKENS_PER_PASS = THREADS // THREADS_PER_TOKEN
"""32 tokens per pass, 4 passes per block: all 16 KiB of loads of a thread in flight at once."""
ROWS_PER_WARP = TOKENS_PER_PASS // WARPS
"""Tokens of a pass one warp holds: its lanes 8 r .. 8 r + 7 hold token row r (``quant.BLOCK_SUM_ORDER``)."""
ROW_BUTTERFLY_OFFSETS = tuple(THREADS_PER_TOKEN << i for i in range(ROWS_PER_WARP.bit_length() - 1))
"""ChannelSumsPerBlock: the lane offsets that add a warp's token rows pairwise, 8 (rows r and r ^ 1), then 16."""
MEAN_THREADS = MEAN_SEGMENTS * HEAD_DIM
"""ChannelMean: one thread per (segment, channel)."""
KEYS_PER_STORE = 16
"""Packed V: consecutive key positions one thread stores (16 bytes) for one channel."""
STORES_PER_ROW = BLOCK // KEYS_PER_STORE
"""Packed V: the neighbouring threads that store one row's 128 positions of a block: a warp writes whole 128-byte
rows, full 32-byte sectors."""
SV8_SWIZZLE = (3, 4, 7)
"""Packed V's ``sV8[key, channel]``: the 16-byte chunk of a row (byte-offset bits 4-6) XOR key bits 4-6 (offset bits
11-13). The 8 key rows a warp's byte read takes (positions 16 g + i, keys 16 g + (0..15)) then sit in 8 different
banks; the token-major 16-byte stores stay whole (bits 0-3 are not swizzled)."""
PERMUTATION_SHAPE = ((2, 2, 4, 2), BLOCK // CHUNK)
PERMUTATION_STRIDE = ((1, 8, 2, 16), CHUNK)
"""Packed-V position -> key within the block, ``layout.chunk_key`` as a layout: position
p = b0 + 2 b1 + 4 lane + 16 half + 32 chunk holds key b0 + 8 b1 + 2 lane + 16 half + 32 chunk."""


def token_major_copy(dtype: type[cutlass.Numeric]) -> cute.TiledCopy:
    """A (tokens, channels) tile split over 256 threads: thread t takes token t // 8, channels 16 (t % 8) + (0..15).

    thr (32, 8):(8, 1) so eight neighbouring threads read one token's 256 contiguous bytes; val (1, 16).
    """
    thr = cute.make_layout((TOKENS_PER_PASS, THREADS_PER_TOKEN), stride=(THREADS_PER_TOKEN, 1))
    val = cute.make_layout((1, CHANNELS_PER_THREAD))
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=128)
    return cute.make_tiled_copy_tv(atom, thr, val)


def _row_major_copy(dtype: type[cutlass.Numeric], rows: int) -> cute.TiledCopy:
    """A (rows, positions) tile of packed V: thread t takes row t // 8 and positions 16 (t % 8) + (0..15), so eight
    neighbouring threads store one row's 128 bytes.

    thr (rows, 8):(8, 1), val (1, 16): 16 consecutive key positions, one 16-byte store.
    """
    thr = cute.make_layout((rows, STORES_PER_ROW), stride=(STORES_PER_ROW, 1))
    val = cute.make_layout((1, KEYS_PER_STORE))
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=128)
    return cute.make_tiled_copy_tv(atom, thr, val)


def _scaled(stride, factor: int):
    """A (nested) stride tuple times ``factor``."""
    return tuple(_scaled(s, factor) for s in stride) if isinstance(stride, tuple) else stride * factor


@cute.jit
def block_coords(mX: cute.Tensor, n: Int32, tidx: Int32) -> cute.Tensor:
    """The (token, channel) coordinates of this thread's 64 values of block n of ``mX`` (B, S, H, 128), in the
    order ``load_block`` holds them."""
    cX = cute.local_tile(cute.make_identity_tensor((mX.shape[1], HEAD_DIM)), (BLOCK, HEAD_DIM), (n, 0))
    return token_major_copy(mX.element_type).get_slice(tidx).partition_S(cX)


@cute.jit
def load_block(
    mX: cute.Tensor, b: Int32, h: Int32, n: Int32, tidx: Int32, token_stride: cutlass.Constexpr[int] = 1
) -> cute.Tensor:
    """This thread's 64 values of block n of ``mX`` (B, S, H, 128) at (b, h): of every ``token_stride``-th token
    only (the others read as 0, unloaded: K's mean, ``MEAN_TOKEN_STRIDE``); tokens past S read as 0.

    Returns the register fragment ((16), 4 passes, 1).
    """
    seq_len = mX.shape[1]
    tiled_copy = token_major_copy(mX.element_type)
    thr_copy = tiled_copy.get_slice(tidx)
    gX = cute.local_tile(mX[b, None, h, None], (BLOCK, HEAD_DIM), (n, 0))
    tXgX = thr_copy.partition_S(gX)
    tXcX = block_coords(mX, n, tidx)
    tXrX = cute.make_rmem_tensor_like(tXgX)
    tXrX.fill(0)
    for p in cutlass.range_constexpr(cute.size(tXgX, mode=[1])):
        token = tXcX[0, p, 0][0]
        # A block and a pass start at multiples of the stride: the same threads load in every pass.
        if token < seq_len and token % token_stride == 0:
            cute.copy(tiled_copy, tXgX[None, p, None], tXrX[None, p, None])
    return tXrX


@cute.jit
def _block_absmax(x: cute.TensorSSA, reduction_buffer: cute.Tensor) -> Float32:
    """max |x| over the CTA, returned to every thread; NaN if any element is NaN, as torch's amax (every max
    here propagates NaN: ``quant.poison_non_finite`` reads it). ``reduction_buffer``: smem (WARPS,) fp32."""
    a = cute.math.abs(x).reduce(cute.ReductionOp.MAX, init_val=Float32(0.0), reduction_profile=0)
    a = cute.arch.warp_reduction(a, _max_propagating_nan)
    # warp_idx() lowers to shfl.sync.idx with the full-warp mask (make_warp_uniform): it must run here, with
    # the warp converged. Inside `if lane == 0` only lane 0 executes it (undefined in PTX; in SASS lane 0
    # WARPSYNC.ALL-waits for lanes that are already at bar.sync 0: the H200 hang, notes/prep.md).
    lane, warp = cute.arch.lane_idx(), cute.arch.warp_idx()
    if lane == 0:
        reduction_buffer[warp] = a
    cute.arch.barrier()
    a = reduction_buffer[0]
    for w in cutlass.range_constexpr(1, WARPS):
        a = _max_propagating_nan(a, reduction_buffer[w])
    return a


def _max_propagating_nan(a: Float32, b: Float32) -> Float32:
    return cute.arch.fmax(a, b, nan=True)


@cute.jit
def _scale_and_descale(a: Float32) -> tuple[Float32, Float32]:
    """``quant._scale_and_descale`` rounding for rounding: ``448 / a`` and ``a / 448``, one IEEE division each;
    the floor keeps a NaN absmax NaN, as torch's clamp does."""
    a = _max_propagating_nan(a, Float32(ABSMAX_FLOOR))
    return Float32(FP8_MAX) / a, a / Float32(FP8_MAX)


@cute.jit
def _to_e4m3(x: cute.TensorSSA, scale: Float32) -> cute.TensorSSA:
    """RNE to E4M3 with saturation (cvt.rn.satfinite.e4m3x2.f32): ``quant.to_e4m3`` of ``x * scale``."""
    return (x * scale).to(cutlass.Float8E4M3FN)


@cute.jit
def minus_channel_mean(x: cute.TensorSSA, mean: cute.Tensor, coords: cute.Tensor, seq_len: Int32) -> cute.TensorSSA:
    """``x - mean[channel]`` in FP32 for real tokens (``quant.smoothing_mean``); padding tokens stay 0, as the
    reference pads after smoothing. ``mean``: this head's (128,) FP32 channel means; the thread's 16 channels
    are the same in every pass, so their means are loaded once."""
    centered = cute.make_rmem_tensor(x.shape, Float32)
    centered.store(x)
    channels = cute.size(centered, mode=[0])
    means = cute.make_rmem_tensor(channels, Float32)
    for i in cutlass.range_constexpr(channels):
        means[i] = mean[coords[i, 0, 0][1]]
    for p in cutlass.range_constexpr(cute.size(centered, mode=[1])):
        if coords[0, p, 0][0] < seq_len:
            for i in cutlass.range_constexpr(channels):
                centered[i, p, 0] = centered[i, p, 0] - means[i]
    return centered.load()


@cute.jit
def _store_residual_energy(
    x: cute.TensorSSA, x8: cute.TensorSSA, descale: Float32, coords: cute.Tensor, energy: cute.Tensor
):
    """``energy[token] = sum_c (x - descale * x8)^2`` over the block's real tokens (``repair.residual_energy``:
    the same residuals, summed in another order). A thread holds 16 channels of 4 tokens; 8 neighbouring lanes
    share a token.

    ``energy``: this head's (S,) FP32 row. The product is rounded on its own (``mul.rn``), as torch's two
    kernels round it: contracted into an FMA, the residuals of well-quantized values would come out different.
    """
    values = cute.make_rmem_tensor(x.shape, Float32)
    values.store(x)
    decoded = cute.make_rmem_tensor(x.shape, Float32)
    decoded.store(x8.to(Float32))  # the FP8 fragment's shape groups the same 16 values differently
    for p in cutlass.range_constexpr(cute.size(values, mode=[1])):
        total = Float32(0.0)
        for i in cutlass.range_constexpr(cute.size(values, mode=[0])):
            residual = values[i, p, 0] - mul_rn(decoded[i, p, 0], descale)
            total += residual * residual
        # The THREADS_PER_TOKEN = 8 lanes of a token: a butterfly over lane bits 0..2, all lanes converged.
        for bit in cutlass.range_constexpr(3):
            total += cute.arch.shuffle_sync_bfly(total, offset=1 << bit)
        token, channel = coords[0, p, 0]
        if channel == 0:
            if token < energy.shape[0]:
                energy[token] = total


@cute.jit
def store_quantized_block(
    x: cute.TensorSSA, mX8: cute.Tensor, mD: cute.Tensor, b: Int32, h: Int32, n: Int32, reduction_buffer: cute.Tensor
):
    """Block n of (b, h), this thread's FP32 values ``x`` (as ``load_block`` holds them), quantized with the block's
    scale (``quant.quantize_per_block``) into ``mX8`` (B, H, S_pad, 128) uint8 and its descale into ``mD``
    (B, H, n_blocks). ``reduction_buffer``: ``_block_absmax``'s, not read by any thread until every thread has
    passed this call's barrier."""
    tidx, _, _ = cute.arch.thread_idx()
    a = _block_absmax(x, reduction_buffer)
    scale, descale = _scale_and_descale(a)
    # Padding tokens hold 0 and quantize to 0: the whole padded block is written, unpredicated.
    gX8 = cute.local_tile(cute.recast_tensor(mX8[b, h, None, None], cutlass.Float8E4M3FN), (BLOCK, HEAD_DIM), (n, 0))
    tiled_copy = token_major_copy(cutlass.Float8E4M3FN)
    tXgX8 = tiled_copy.get_slice(tidx).partition_D(gX8)
    tXrX8 = cute.make_rmem_tensor_like(tXgX8)
    tXrX8.store(_to_e4m3(x, scale))
    cute.copy(tiled_copy, tXrX8, tXgX8)
    if tidx == 0:
        mD[b, h, n] = descale


class QuantizePerBlock:
    """Q or K: one scale per 128-token block, optionally of K minus its channel mean. Grid (n_blocks, H, B).

    ``beside_previous``: for Q, which reads nothing the preparation writes; the kernel starts beside the launch before
    it and completes after it (``dependent_launch.start_beside_previous_launch``: its rule), so that Q's quantization
    fills the SMs that the tokens' choice, on a few of them, leaves idle."""

    def __init__(self, beside_previous: bool = False):
        self.beside_previous = beside_previous

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,
        mX8: cute.Tensor,
        mD: cute.Tensor,
        mMean: cute.Tensor | None,
        stream: cuda.CUstream,
    ):
        """mX (B, S, H, 128) fp16/bf16; mX8 (B, H, S_pad, 128) uint8, rows contiguous; mD (B, H, n_blocks) fp32;
        mMean (B, H, 128) fp32 channel means to subtract, or None."""
        self.kernel(mX, mX8, mD, mMean).launch(
            grid=[mD.shape[2], mD.shape[1], mD.shape[0]], block=[THREADS, 1, 1], stream=stream,
            **launch_options(),
        )

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mX8: cute.Tensor, mD: cute.Tensor, mMean: cute.Tensor | None):
        if cutlass.const_expr(self.beside_previous):
            start_beside_previous_launch()
        else:
            follow_previous_launch()
        tidx, _, _ = cute.arch.thread_idx()
        n, h, b = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        reduction_buffer = smem.allocate_tensor(Float32, cute.make_layout(WARPS))

        tXrX = load_block(mX, b, h, n, tidx)
        x = tXrX.load().to(Float32)
        if cutlass.const_expr(mMean is not None):
            x = minus_channel_mean(x, mMean[b, h, None], block_coords(mX, n, tidx), mX.shape[1])
        store_quantized_block(x, mX8, mD, b, h, n, reduction_buffer)
        if cutlass.const_expr(self.beside_previous):
            last_cta = (n == mD.shape[2] - 1) & (h == mD.shape[1] - 1) & (b == mD.shape[0] - 1)
            complete_after_previous_launch(last_cta)


@cute.jit
def _store_channel_sums(values: cute.Tensor, coords: cute.Tensor, sums_row: cute.Tensor, warp_sums: cute.Tensor):
    """``ChannelSumsPerBlock``'s sums of this thread's block fragment ``values`` (FP32, as ``load_block`` holds
    it; ``coords`` from ``block_coords``) into ``sums_row`` (128,) fp32. ``warp_sums``: smem (WARPS, 128) fp32."""
    tidx, _, _ = cute.arch.thread_idx()
    channels, passes = cute.size(values, mode=[0]), cute.size(values, mode=[1])
    sums = cute.make_rmem_tensor(channels, Float32)
    for i in cutlass.range_constexpr(channels):
        total = values[i, 0, 0]
        for p in cutlass.range_constexpr(1, passes):
            total = total + values[i, p, 0]
        for offset in ROW_BUTTERFLY_OFFSETS:
            total = total + cute.arch.shuffle_sync_bfly(total, offset=offset)
        sums[i] = total
    # warp_idx() with the warp converged (see _block_absmax).
    lane, warp = cute.arch.lane_idx(), cute.arch.warp_idx()
    if lane < THREADS_PER_TOKEN:
        for i in cutlass.range_constexpr(channels):
            warp_sums[warp, coords[i, 0, 0][1]] = sums[i]
    cute.arch.barrier()
    if tidx < HEAD_DIM:
        total = warp_sums[0, tidx]
        for w in cutlass.range_constexpr(1, WARPS):
            total = total + warp_sums[w, tidx]
        sums_row[tidx] = total


def _allocate_warp_sums(smem: cutlass.memory.SmemAllocator) -> cute.Tensor:
    """sWarpSums: (warp 8, channel 128):(128, 1) fp32, ``_store_channel_sums``' exchange."""
    return smem.allocate_tensor(Float32, cute.make_layout((WARPS, HEAD_DIM), stride=(HEAD_DIM, 1)))


@cute.jit
def _merge_absmax(x: cute.TensorSSA, mAmax: cute.Tensor, b: Int32, h: Int32, reduction_buffer: cute.Tensor):
    """``mAmax[b, h] = max(mAmax[b, h], absmax of the CTA's block x)``: ``AbsmaxPerHead``'s step."""
    tidx, _, _ = cute.arch.thread_idx()
    a = _block_absmax(x, reduction_buffer)
    if tidx == 0:
        # a >= 0: integer max on its bits (atom.max.s32) is the float max, exact in any order; the canonical
        # NaN (0x7fffffff) beats inf and every finite value, so a NaN absmax stays NaN.
        cute.arch.atomic_fmax(mAmax.iterator + cute.crd2idx((b, h), mAmax.layout), a, sign_bit=False)


class ChannelSumsPerBlock:
    """K smoothing, pass 1: each block's per-channel FP32 sums of every ``MEAN_TOKEN_STRIDE``-th key
    (``quant.channel_block_sums``, bit for bit). Grid (n_blocks, H, B).

    A thread adds its 4 passes in order, a butterfly over lane bits 3 and 4 adds the warp's 4 token rows pairwise
    (every lane then holds (0 + 1) + (2 + 3): addition commutes), and thread c < 128 adds the 8 warps' sums of
    channel c in order, through shared memory.
    """

    @cute.jit
    def __call__(self, mK: cute.Tensor, mSums: cute.Tensor, stream: cuda.CUstream):
        """mK (B, S, H, 128) fp16/bf16; mSums (B, H, n_blocks, 128) fp32."""
        self.kernel(mK, mSums).launch(
            grid=[mSums.shape[2], mSums.shape[1], mSums.shape[0]], block=[THREADS, 1, 1], stream=stream,
            **launch_options(),
        )

    @cute.kernel
    def kernel(self, mK: cute.Tensor, mSums: cute.Tensor):
        follow_previous_launch()
        tidx, _, _ = cute.arch.thread_idx()
        n, h, b = cute.arch.block_idx()
        warp_sums = _allocate_warp_sums(cutlass.memory.SmemAllocator())
        coords = block_coords(mK, n, tidx)
        values = cute.make_rmem_tensor(coords.shape, Float32)
        values.store(load_block(mK, b, h, n, tidx, MEAN_TOKEN_STRIDE).load().to(Float32))
        _store_channel_sums(values, coords, mSums[b, h, n, None], warp_sums)


class ChannelMean:
    """K smoothing, pass 2: ``quant.channel_mean`` from the block sums, bit for bit. Grid (H, B), MEAN_THREADS
    threads: thread (segment j, channel c) adds the sums of its segment's blocks in order from 0, thread c < 128
    the segments in order, then one IEEE division by the count of keys summed."""

    @cute.jit
    def __call__(self, mSums: cute.Tensor, mMean: cute.Tensor, tokens: Int32, stream: cuda.CUstream):
        """mSums (B, H, n_blocks, 128) fp32 (``ChannelSumsPerBlock``); mMean (B, H, 128) fp32; ``tokens``
        ``quant.mean_tokens(S)``."""
        self.kernel(mSums, mMean, tokens).launch(
            grid=[mMean.shape[1], mMean.shape[0], 1], block=[MEAN_THREADS, 1, 1], stream=stream,
            **launch_options(),
        )

    @cute.kernel
    def kernel(self, mSums: cute.Tensor, mMean: cute.Tensor, tokens: Int32):
        follow_previous_launch()
        tidx, _, _ = cute.arch.thread_idx()
        h, b, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        # sSegmentSums: (segment 8, channel 128):(128, 1) fp32.
        segment_sums = smem.allocate_tensor(
            Float32, cute.make_layout((MEAN_SEGMENTS, HEAD_DIM), stride=(HEAD_DIM, 1))
        )
        segment, channel = tidx // HEAD_DIM, tidx % HEAD_DIM
        n_blocks = mSums.shape[2]
        part = Float32(0.0)
        # Unrolled: the loads of eight blocks in flight at once, their sums still in order.
        for i in cutlass.range(segment * n_blocks // MEAN_SEGMENTS, (segment + 1) * n_blocks // MEAN_SEGMENTS,
                               unroll=8):
            part = part + mSums[b, h, i, channel]
        segment_sums[segment, channel] = part
        cute.arch.barrier()
        if tidx < HEAD_DIM:
            total = segment_sums[0, tidx]
            for j in cutlass.range_constexpr(1, MEAN_SEGMENTS):
                total = total + segment_sums[j, tidx]
            mMean[b, h, tidx] = total / Float32(tokens)


class AbsmaxPerHead:
    """V pass 1: ``amax[b, h] = max(amax[b, h], absmax of the block)``; amax must start at 0. Grid (n_blocks, H, B)."""

    @cute.jit
    def __call__(self, mV: cute.Tensor, mAmax: cute.Tensor, stream: cuda.CUstream):
        """mV (B, S, H, 128) fp16/bf16; mAmax (B, H) fp32, zeroed."""
        n_blocks = cute.ceil_div(mV.shape[1], BLOCK)
        self.kernel(mV, mAmax).launch(
            grid=[n_blocks, mV.shape[2], mV.shape[0]], block=[THREADS, 1, 1], stream=stream,
            **launch_options(),
        )

    @cute.kernel
    def kernel(self, mV: cute.Tensor, mAmax: cute.Tensor):
        follow_previous_launch()
        tidx, _, _ = cute.arch.thread_idx()
        n, h, b = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        reduction_buffer = smem.allocate_tensor(Float32, cute.make_layout(WARPS))
        x = load_block(mV, b, h, n, tidx).load().to(Float32)
        _merge_absmax(x, mAmax, b, h, reduction_buffer)


class AbsmaxAndChannelSums:
    """``AbsmaxPerHead`` of V and ``ChannelSumsPerBlock`` of K in one launch, the same bits: the first pass over
    both when neither V's absmax nor K's mean is given (K smoothing). Block n of head h of V and every
    ``MEAN_TOKEN_STRIDE``-th key of K's are both loaded before either is reduced (in SASS a thread's 16 loads all
    precede its first shuffle). Grid (n_blocks, H, B)."""

    @cute.jit
    def __call__(
        self,
        mV: cute.Tensor,
        mK: cute.Tensor,
        mAmax: cute.Tensor,
        mSums: cute.Tensor,
        mCos: cute.Tensor | None,
        mSin: cute.Tensor | None,
        stream: cuda.CUstream,
    ):
        """mV, mK (B, S, H, 128) fp16/bf16 of the same shape; mAmax (B, H) fp32, zeroed; mSums (B, H, n_blocks,
        128) fp32; mCos, mSin: None here (``rotary_quant.AbsmaxAndRotatedChannelSums`` reads them)."""
        self.kernel(mV, mK, mAmax, mSums, mCos, mSin).launch(
            grid=[mSums.shape[2], mSums.shape[1], mSums.shape[0]], block=[THREADS, 1, 1], stream=stream,
            **launch_options(),
        )

    @cute.jit
    def summed_values(
        self, k_block: cute.Tensor, coords: cute.Tensor, mCos: cute.Tensor | None, mSin: cute.Tensor | None
    ) -> cute.TensorSSA:
        """The FP32 values whose channel sums are taken, from this thread's fragment of K's block."""
        return k_block.load().to(Float32)

    @cute.kernel
    def kernel(
        self,
        mV: cute.Tensor,
        mK: cute.Tensor,
        mAmax: cute.Tensor,
        mSums: cute.Tensor,
        mCos: cute.Tensor | None,
        mSin: cute.Tensor | None,
    ):
        follow_previous_launch()
        tidx, _, _ = cute.arch.thread_idx()
        n, h, b = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        reduction_buffer = smem.allocate_tensor(Float32, cute.make_layout(WARPS))
        warp_sums = _allocate_warp_sums(smem)
        v_block = load_block(mV, b, h, n, tidx)
        k_block = load_block(mK, b, h, n, tidx, MEAN_TOKEN_STRIDE)
        _merge_absmax(v_block.load().to(Float32), mAmax, b, h, reduction_buffer)
        coords = block_coords(mK, n, tidx)
        values = cute.make_rmem_tensor(coords.shape, Float32)
        values.store(self.summed_values(k_block, coords, mCos, mSin))
        _store_channel_sums(values, coords, mSums[b, h, n, None], warp_sums)


class PackV:
    """V pass 2: quantize with the head's scale, then transpose, permute keys and add the ones rows; optionally
    each token's residual energy, which ranks the V residual repair candidates.

    Grid (n_blocks, H, B). The block goes through shared memory as E4M3 ``sV8[key, channel]`` (128 x 128
    bytes, row-major, 16-byte chunks swizzled: ``SV8_SWIZZLE``); packed V reads it back through
    ``(channel, position) -> sV8[perm(position), channel]`` and stores whole rows (``_row_major_copy``).
    ``last_read_first``: CTA (x, y, z) takes block (n_blocks - 1 - x, H - 1 - y, B - 1 - z), so that the CTAs
    launched first read the blocks V's absmax launch (pass 1, right before) read last, which L2 may still hold
    (False: block (x, y, z), for ``notes/probe_prep_order.py``).
    """

    def __init__(self, last_read_first: bool = True):
        self.last_read_first = last_read_first

    @cute.jit
    def __call__(
        self,
        mV: cute.Tensor,
        mAmax: cute.Tensor,
        mVp: cute.Tensor,
        mDv: cute.Tensor,
        mEnergy: cute.Tensor | None,
        stream: cuda.CUstream,
    ):
        """mV (B, S, H, 128) fp16/bf16; mAmax (B, H) fp32; mVp (B, H, 136, S_pad) uint8, rows contiguous;
        mDv (B, H) fp32; mEnergy (B, H, S) fp32 or None."""
        n_blocks = cute.ceil_div(mV.shape[1], BLOCK)
        self.kernel(mV, mAmax, mVp, mDv, mEnergy).launch(
            grid=[n_blocks, mV.shape[2], mV.shape[0]], block=[THREADS, 1, 1], stream=stream,
            **launch_options(),
        )

    @cute.kernel
    def kernel(
        self, mV: cute.Tensor, mAmax: cute.Tensor, mVp: cute.Tensor, mDv: cute.Tensor, mEnergy: cute.Tensor | None
    ):
        follow_previous_launch()
        tidx, _, _ = cute.arch.thread_idx()
        n, h, b = cute.arch.block_idx()
        if cutlass.const_expr(self.last_read_first):
            blocks, heads, batch = cute.arch.grid_dim()
            n, h, b = blocks - 1 - n, heads - 1 - h, batch - 1 - b
        smem = cutlass.memory.SmemAllocator()
        # sV8: (key 128, channel 128):(128, 1) bytes, Swizzle<3,4,7> on the byte offset.
        swizzle = cute.make_swizzle(*SV8_SWIZZLE)
        sV8 = smem.allocate_tensor(
            cutlass.Float8E4M3FN,
            cute.make_composed_layout(swizzle, 0, cute.make_layout((BLOCK, HEAD_DIM), stride=(HEAD_DIM, 1))),
            byte_alignment=1024,
        )

        x = load_block(mV, b, h, n, tidx).load().to(Float32)
        scale, descale = _scale_and_descale(mAmax[b, h])
        tiled_copy = token_major_copy(cutlass.Float8E4M3FN)
        tVsV8 = tiled_copy.get_slice(tidx).partition_D(sV8)
        tVrV8 = cute.make_rmem_tensor_like(tVsV8)
        tVrV8.store(_to_e4m3(x, scale))
        cute.copy(tiled_copy, tVrV8, tVsV8)
        if cutlass.const_expr(mEnergy is not None):
            _store_residual_energy(x, tVrV8.load(), descale, block_coords(mV, n, tidx), mEnergy[b, h, None])
        cute.arch.barrier()

        # Packed tile (channel 128, position 128) -> sV8[perm(position), channel]:
        # (128, ((2,2,4,2),4)):(1, ((128,1024,256,2048),4096)) bytes, then the swizzle. Thread t stores channels
        # t // 8 + 32 i, i = 0..3, positions 16 (t % 8) + (0..15): each byte read of a warp takes 4 channels of 8
        # key rows 16 apart (8 banks by the swizzle, one wavefront), and each store writes 4 whole packed rows.
        sPacked = cute.make_tensor(
            sV8.iterator,
            cute.make_composed_layout(
                swizzle,
                0,
                cute.make_layout((HEAD_DIM, PERMUTATION_SHAPE), stride=(1, _scaled(PERMUTATION_STRIDE, HEAD_DIM))),
            ),
        )
        mVp_bh = mVp[b, h, None, None]
        gVp = cute.local_tile(cute.recast_tensor(mVp_bh, cutlass.Float8E4M3FN), (HEAD_DIM, BLOCK), (0, n))
        packed_copy = _row_major_copy(cutlass.Float8E4M3FN, THREADS // STORES_PER_ROW)
        thr_packed = packed_copy.get_slice(tidx)
        tPgP = thr_packed.partition_D(gVp)
        tPrP = cute.make_rmem_tensor_like(tPgP)
        cute.autovec_copy(thr_packed.partition_S(sPacked), tPrP)
        cute.copy(packed_copy, tPrP, tPgP)

        # Ones rows 128..135: 1.0 for real keys, 0 for padding; threads 0..63 store 16 positions each.
        if tidx < ONES_ROWS * STORES_PER_ROW:
            ones_copy = _row_major_copy(Uint8, ONES_ROWS)
            gOnes = cute.local_tile(mVp_bh, (ONES_ROWS, BLOCK), (HEAD_DIM // ONES_ROWS, n))
            tOgO = ones_copy.get_slice(tidx).partition_D(gOnes)
            tOrO = cute.make_rmem_tensor_like(tOgO)
            tOrO.fill(0)
            # This thread's positions 16 g + i hold keys 16 g + KEY_PERMUTATION[i] (halves map to halves).
            first_key = n * BLOCK + (tidx % STORES_PER_ROW) * KEYS_PER_STORE
            for i in cutlass.range_constexpr(KEYS_PER_STORE):
                if first_key + KEY_PERMUTATION[i] < mV.shape[1]:
                    tOrO[i] = Uint8(E4M3_ONE)
            cute.copy(ones_copy, tOrO, tOgO)
        if n == 0 and tidx == 0:
            mDv[b, h] = descale


REPAIR_THREADS_PER_KEY = 16
"""RepairRows: threads per repair key, each taking 8 consecutive channels (16 threads read a K row's 128 bytes):
enough CTAs that a few thousand repair keys fill the GPU, each thread's few gathers from packed V in flight at once."""
REPAIR_CHANNELS = HEAD_DIM // REPAIR_THREADS_PER_KEY
REPAIR_KEYS_PER_CTA = THREADS // REPAIR_THREADS_PER_KEY


@cute.jit
def _packed_position(key: Int32) -> Int32:
    """``layout.packed_position`` of one key index: its packed-V column."""
    b0, lane, b1, half = key & 1, (key >> 1) & 3, (key >> 3) & 1, (key >> 4) & 1
    return (key & ~(CHUNK - 1)) + b0 + 2 * b1 + 4 * lane + 16 * half


@cute.jit
def _key_channels(row: cute.Tensor, tidx: Int32) -> cute.Tensor:
    """This thread's ``REPAIR_CHANNELS`` consecutive channels of a (128,) row: one vector access."""
    return cute.local_tile(row, (REPAIR_CHANNELS,), (tidx % REPAIR_THREADS_PER_KEY,))


class RepairRows:
    """The V residual repair keys (``preparation.write_repair_rows``, byte for byte): repair key j < count is token
    t = tokens[j]'s K row with its block's descale and index, and its value row ``e4m3(r / d_V)``,
    ``r = V - d_V V8``, in packed V with 0 in the ones rows; keys count .. R - 1 are zero keys in tile 0. Grid
    (R / 16, H, B); 256 threads, 16 per key, each taking 8 of its channels.

    V8 is quantized again from V with the head's scale, as ``PackV`` quantized it (the same bytes): one 16-byte load
    of V instead of 8 single bytes gathered from packed V's rows.
    """

    @cute.jit
    def __call__(
        self,
        mV: cute.Tensor,
        mAmax: cute.Tensor,
        mTokens: cute.Tensor,
        mK8: cute.Tensor,
        mDk: cute.Tensor,
        mVp: cute.Tensor,
        mDv: cute.Tensor,
        mDkRepair: cute.Tensor,
        mTileRepair: cute.Tensor,
        stream: cuda.CUstream,
    ):
        """mV (B, S, H, 128) fp16/bf16; mAmax (B, H) fp32, V's absmax (``PackV``'s); mTokens (B, H, count) int64;
        mK8 (B, H, S_pad + R, 128) uint8; mDk (B, H, n_blocks) fp32; mVp (B, H, 136, S_pad + R) uint8; mDv (B, H)
        fp32; mDkRepair (B, H, R) fp32; mTileRepair (B, H, R) int32. The real keys (k8, d_k, d_v) are read, the
        repair keys written."""
        self.kernel(mV, mAmax, mTokens, mK8, mDk, mVp, mDv, mDkRepair, mTileRepair).launch(
            grid=[mDkRepair.shape[2] // REPAIR_KEYS_PER_CTA, mDkRepair.shape[1], mDkRepair.shape[0]],
            block=[THREADS, 1, 1],
            stream=stream,
            **launch_options(),
        )

    @cute.kernel
    def kernel(
        self,
        mV: cute.Tensor,
        mAmax: cute.Tensor,
        mTokens: cute.Tensor,
        mK8: cute.Tensor,
        mDk: cute.Tensor,
        mVp: cute.Tensor,
        mDv: cute.Tensor,
        mDkRepair: cute.Tensor,
        mTileRepair: cute.Tensor,
    ):
        follow_previous_launch()
        tidx, _, _ = cute.arch.thread_idx()
        n, h, b = cute.arch.block_idx()
        key = n * REPAIR_KEYS_PER_CTA + tidx // REPAIR_THREADS_PER_KEY
        s_pad = mDk.shape[2] * BLOCK
        row = s_pad + key
        column = s_pad + _packed_position(key)
        k_row = cute.make_rmem_tensor(REPAIR_CHANNELS, Uint8)
        residual8 = cute.make_rmem_tensor(REPAIR_CHANNELS, cutlass.Float8E4M3FN)
        residual8_bytes = cute.recast_tensor(residual8, Uint8)
        if key < mTokens.shape[2]:
            token = Int32(mTokens[b, h, key])
            tile = token // BLOCK
            cute.autovec_copy(_key_channels(mK8[b, h, token, None], tidx), k_row)
            v_row = cute.make_rmem_tensor(REPAIR_CHANNELS, mV.element_type)
            cute.autovec_copy(_key_channels(mV[b, token, h, None], tidx), v_row)
            scale, _ = _scale_and_descale(mAmax[b, h])
            d_v = mDv[b, h]
            values = cute.make_rmem_tensor(REPAIR_CHANNELS, Float32)
            values.store(v_row.load().to(Float32))
            decoded = cute.make_rmem_tensor(REPAIR_CHANNELS, Float32)
            decoded.store(_to_e4m3(values.load(), scale).to(Float32))
            residual = cute.make_rmem_tensor(REPAIR_CHANNELS, Float32)
            for c in cutlass.range_constexpr(REPAIR_CHANNELS):
                # The product rounded on its own and one IEEE division, as torch's kernels round them.
                residual[c] = (values[c] - mul_rn(d_v, decoded[c])) / d_v
            residual8.store(residual.load().to(cutlass.Float8E4M3FN))
            if tidx % REPAIR_THREADS_PER_KEY == 0:
                mDkRepair[b, h, key] = mDk[b, h, tile]
                mTileRepair[b, h, key] = tile
        else:
            k_row.fill(0)
            residual8_bytes.fill(0)
            if tidx % REPAIR_THREADS_PER_KEY == 0:
                mDkRepair[b, h, key] = Float32(0.0)
                mTileRepair[b, h, key] = Int32(0)
        cute.autovec_copy(k_row, _key_channels(mK8[b, h, row, None], tidx))
        first_channel = (tidx % REPAIR_THREADS_PER_KEY) * REPAIR_CHANNELS
        for c in cutlass.range_constexpr(REPAIR_CHANNELS):
            mVp[b, h, first_channel + c, column] = residual8_bytes[c]
        if tidx % REPAIR_THREADS_PER_KEY == 0:
            for i in cutlass.range_constexpr(ONES_ROWS):
                mVp[b, h, HEAD_DIM + i, column] = Uint8(0)
