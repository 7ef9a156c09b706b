"""FP8 ExpCast attention forward for Hopper (sm_90a): one CTA per unit (128-row query tile, head, batch), or per
piece of a unit in the last wave (the tail split, ``kernels/split.py``; merged in ``pieces.py``).

Roles: warpgroup 0 is the producer (its warp 0 issues every TMA load, K(i + 1) ahead of V(i));
warpgroups 1 and 2 are consumers, 64 query rows each, sharing the query tile's Q descale. Per key
tile i a consumer issues QK^T(i) and PV(i - 1) back to back, then runs the ExpCast softmax of tile i.
Registers per consumer thread: S 64, PV 68, O 68, P 16; with so little room ptxas retires PV(i - 1)
before the softmax, so the two consumer warpgroups overlap each other (ping-pong: they take turns
issuing their wgmmas, one's softmax under the other's matrix products) rather than each overlapping itself.

Shared memory (FP8 bytes, 128B-swizzled, K-major rows of 128 bytes):
  sQ  (128 query rows, 128 channels)
  sK  (128 keys, 128 channels, KV_STAGES)
  sV  (136 packed-V rows, 128 key positions, KV_STAGES)   rows 128..135 are the ones rows
Global inputs (all FP8 as uint8 bytes): q8 (B, H, Sq_pad, 128), k8 (B, H, Sk_pad + R, 128); packed V
(B, H, 136, Sk_pad + R); descales d_q (B, H, n_q), d_k (B, H, n_k), d_v (B, H), d_k_repair (B, H, R) for the
R V-repair keys after the real ones (visited last, on the final anchor, ones rows 0; a piece keeps those whose
token's tile, tile_repair (B, H, R) int32, it visited), in repair_tiles tiles: R is a multiple of 64
(``preparation.repair_room``), and a last tile of 64 keys runs as half a tile (``HALF_TILE_N``);
output (B, S, H, 128) bf16; with ``ForwardConfig.write_lse`` each row's log-sum-exp lse (B, H, S) fp32; the split's
workspace (``pieces.py``).

Grid: one dimension, units in (query tile, head, batch) order, the last ones split: CTA c < whole_units runs unit
c, CTA whole_units + t runs piece t % splits of unit whole_units + t // splits.
"""

import functools
import inspect
from typing import NamedTuple

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_helpers
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait
from cutlass.tensor_utils import LayoutEnum

from ..quant import BLOCK
from ..support import HEAD_DIM
from . import epilogue, pieces, softmax
from .ptx import mul_rn
from .barriers import NamedBarrier
from .config import ForwardConfig
from .dependent_launch import follow_previous_launch, launch_options
from .layout import CHUNK, PV_N

FP8 = cutlass.Float8E4M3FN
TILE_M = BLOCK
"""Query rows per CTA: one Q quantization block, so one d_q per CTA."""
TILE_N = BLOCK
"""Keys per tile: one K quantization block, so one d_k per tile."""
HALF_TILE_N = TILE_N // 2
"""Keys of a last repair tile that holds no more (``preparation.repair_room``): its QK^T is one n64 wgmma on the
first 64 rows of the K stage, its PV the first two of the four 32-key k-blocks, its softmax half the columns. The
loads stay whole tiles: TMA fills the rows past the tensor's end with zeros."""
WG_THREADS = 128
CONSUMER_WGS = 2
"""Each consumer warpgroup owns 64 of the tile's rows (the wgmma M)."""
PRODUCER_REGS = 24
CONSUMER_REGS = 240
SMEM_ALIGN = 1024
"""The 128B swizzle pattern repeats every 1024 bytes; each buffer starts on one."""


def _smem_layout(rows: int, stages: int | None = None):
    """K-major FP8 tile of ``rows`` x 128 bytes (one 128B swizzle atom wide), optionally staged."""
    atom = warpgroup.make_smem_layout_atom(
        sm90_helpers.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, FP8, HEAD_DIM), FP8
    )
    if stages is None:
        return cute.tile_to_shape(atom, (rows, HEAD_DIM), order=(0, 1))
    return cute.tile_to_shape(atom, (rows, HEAD_DIM, stages), order=(0, 1, 2))


def _as_fp8_tma_view(t: cute.Tensor) -> cute.Tensor:
    """uint8 (B, H, rows, cols) -> FP8 (rows, cols, H, B): tile modes first, for TMA."""
    return cute.make_tensor(
        cute.recast_ptr(t.iterator, dtype=FP8), cute.select(t.layout, mode=[2, 3, 1, 0])
    )


@cute.jit
def _gemm(
    tiled_mma: cute.TiledMma, acc: cute.Tensor, frag_a, frag_b, zero_init, k_blocks: cutlass.Constexpr = None
):
    """Issue one warpgroup's wgmmas over the K blocks (the first ``k_blocks`` of them, default all) and commit them
    as one group (no wait).

    ``zero_init`` may be a run-time Boolean: it is the wgmma's scale-d predicate.
    """
    warpgroup.fence()
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for k in cutlass.range_constexpr(cute.size(frag_a.shape[2]) if k_blocks is None else k_blocks):
        cute.gemm(atom, acc, frag_a[None, None, k], frag_b[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()


class Visit(NamedTuple):
    """A CTA's share of its unit's visiting order: steps ``first .. first + n_real - 1`` of the order over the unit's
    ``n_k`` key tiles that starts at tile ``start`` (``ExpCastAttentionSm90.tile_at``); the repair tiles follow."""

    first: Int32
    n_real: Int32
    start: Int32
    n_k: Int32


class Keys(NamedTuple):
    """What a consumer knows of the keys besides their tiles: the K descales of the real tiles (n_k,) and of the
    repair keys (R,), the repair keys' tokens' tiles (R,), the last real tile, and how many real keys it holds (the
    rest are padding)."""

    d_k: cute.Tensor
    d_k_repair: cute.Tensor
    tile_repair: cute.Tensor
    last_tile: Int32
    last_valid: Int32


class Piece(NamedTuple):
    """Which piece of its unit a CTA runs (``index`` of ``count``; count 1: the whole unit) and the tail split's
    workspace (``pieces.py``): the unit's pieces use slots ``first_slot ..`` of ``sums`` and ``anchors``,
    ``arrivals`` are the unit's two counters, ``seen`` one shared Int32 per consumer warpgroup."""

    index: Int32
    count: Int32
    first_slot: Int32
    sums: cute.Tensor
    anchors: cute.Tensor
    arrivals: cute.Tensor
    seen: cute.Tensor


class Gemms(NamedTuple):
    """One consumer warpgroup's two matrix products: S = Q K^T (SS, into ``acc_s``) and PV = P V (RS: P from the
    registers of ``frag_p``, into ``acc_pv``); ``frag_k`` and ``frag_v`` span the KV stages. A half tile's S
    (``HALF_TILE_N`` keys): ``tiled_qk_half`` from ``frag_k_half``, the stages' first 64 rows, into ``acc_s_half``,
    registers of its own (written into half of ``acc_s``'s, ptxas serializes every wgmma of the kernel)."""

    tiled_qk: cute.TiledMma
    tiled_qk_half: cute.TiledMma
    tiled_pv: cute.TiledMma
    frag_q: cute.Tensor
    frag_k: cute.Tensor
    frag_k_half: cute.Tensor
    frag_v: cute.Tensor
    frag_p: cute.Tensor
    acc_s: cute.Tensor
    acc_s_half: cute.Tensor
    acc_pv: cute.Tensor

    def issue_qk(self, stage: Int32, half: bool = False):
        if half:
            _gemm(self.tiled_qk_half, self.acc_s_half, self.frag_q, self.frag_k_half[None, None, None, stage], True)
        else:
            _gemm(self.tiled_qk, self.acc_s, self.frag_q, self.frag_k[None, None, None, stage], True)

    def issue_pv(self, stage: Int32, fresh: cutlass.Boolean, half: bool = False):
        """``fresh``: start a new PV chain (the wgmma's scale-d predicate off) instead of adding to ``acc_pv``;
        ``half``: the first ``HALF_TILE_N`` keys only."""
        k_blocks = HALF_TILE_N // CHUNK if half else None
        _gemm(self.tiled_pv, self.acc_pv, self.frag_p, self.frag_v[None, None, None, stage], fresh, k_blocks)


def _taken(t: cute.Tensor, taken: bool) -> cute.Tensor | None:
    """``t`` where this config's kernel takes it, else None (plain Python, run while tracing)."""
    return t if taken else None


def _head_rows(t: cute.Tensor | None, batch: Int32, head: Int32) -> cute.Tensor | None:
    """``t[batch, head, None]``, or None for a tensor the kernel does not take."""
    return None if t is None else t[batch, head, None]


@cute.jit
def _tma_load(pipe: pipeline.PipelineAsync, atom: cute.CopyAtom, src: cute.Tensor, dst: cute.Tensor, state):
    """Wait for the stage to be free, then one TMA copy of ``src`` into it, completing on its barrier."""
    pipe.producer_acquire(state)
    cute.copy(atom, src, dst[None, state.index], tma_bar_ptr=pipe.producer_get_barrier(state))


class ExpCastAttentionSm90:
    """The forward kernel of one ``ForwardConfig`` (visiting order and tuning knobs, fixed at compile time)."""

    softmax_class = softmax.ExpCastSoftmax
    """What each consumer thread's softmax is built from; notes/probe_*.py subclass both to compile variants."""

    def __init__(self, config: ForwardConfig):
        self.config = config

    @cute.jit
    def __call__(
        self,
        q8: cute.Tensor,
        k8: cute.Tensor,
        v_packed: cute.Tensor,
        d_q: cute.Tensor,
        d_k: cute.Tensor,
        d_v: cute.Tensor,
        d_k_repair: cute.Tensor,
        tile_repair: cute.Tensor,
        out: cute.Tensor,
        lse: cute.Tensor,
        piece_sums: cute.Tensor,
        piece_anchors: cute.Tensor,
        arrivals: cute.Tensor,
        codes_per_dot: Float32,
        seqlen_k: Int32,
        window: Int32,
        repair_tiles: Int32,
        whole_units: Int32,
        splits: Int32,
        stream: cuda.CUstream,
    ):
        """``codes_per_dot`` is ``expcast.codes_per_dot(softmax_scale)``; times d_q it is each row's codes per score
        ``s`` (``reference.codes_per_score``). The units after ``whole_units`` run ``splits`` pieces each
        (``split.plan_tail_split``). ``lse`` (B, H, S) is written only with
        ``ForwardConfig.write_lse``; the kernel without it does not take it (any FP32 stand-in will do)."""
        mQ, mK, mV = [_as_fp8_tma_view(t) for t in (q8, k8, v_packed)]
        sQ_layout = _smem_layout(TILE_M)
        sK_layout = _smem_layout(TILE_N, self.config.kv_stages)
        sV_layout = _smem_layout(PV_N, self.config.kv_stages)
        operand_k = cute.nvgpu.OperandMajorMode.K
        # Both warpgroups in one tiled MMA (atom layout 2 x 1): a warpgroup's slice is its 64 rows.
        tiled_mma_qk = sm90_helpers.make_trivial_tiled_mma(
            FP8, FP8, operand_k, operand_k, Float32, (CONSUMER_WGS, 1, 1), (64, TILE_N)
        )
        tiled_mma_qk_half = sm90_helpers.make_trivial_tiled_mma(
            FP8, FP8, operand_k, operand_k, Float32, (CONSUMER_WGS, 1, 1), (64, HALF_TILE_N)
        )
        tiled_mma_pv = sm90_helpers.make_trivial_tiled_mma(
            FP8, FP8, operand_k, operand_k, Float32, (CONSUMER_WGS, 1, 1), (64, PV_N),
            warpgroup.OperandSource.RMEM,
        )
        load_op = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, mQ = cpasync.make_tiled_tma_atom(load_op, mQ, sQ_layout, (TILE_M, HEAD_DIM))
        tma_k, mK = cpasync.make_tiled_tma_atom(
            load_op, mK, cute.select(sK_layout, mode=[0, 1]), (TILE_N, HEAD_DIM)
        )
        tma_v, mV = cpasync.make_tiled_tma_atom(
            load_op, mV, cute.select(sV_layout, mode=[0, 1]), (PV_N, TILE_N)
        )
        self.bytes_q = cute.size_in_bytes(FP8, sQ_layout)
        self.bytes_k = cute.size_in_bytes(FP8, cute.select(sK_layout, mode=[0, 1]))
        self.bytes_v = cute.size_in_bytes(FP8, cute.select(sV_layout, mode=[0, 1]))

        stages = self.config.kv_stages

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            arrivals_seen: cute.struct.MemRange[Int32, CONSUMER_WGS]
            sQ: cute.struct.Align[cute.struct.MemRange[FP8, cute.cosize(sQ_layout)], SMEM_ALIGN]
            sK: cute.struct.Align[cute.struct.MemRange[FP8, cute.cosize(sK_layout)], SMEM_ALIGN]
            sV: cute.struct.Align[cute.struct.MemRange[FP8, cute.cosize(sV_layout)], SMEM_ALIGN]

        n_q_tiles = q8.shape[2] // TILE_M
        units = n_q_tiles * q8.shape[1] * q8.shape[0]
        # Divisors for the CTA's unit and piece, by multiply and shift (an integer division would convert).
        divisors = [cute.fast_divmod_create_divisor_v2(x) for x in (n_q_tiles, q8.shape[1], splits)]
        self.kernel(
            mQ, mK, mV, d_q, d_k, d_v, d_k_repair, tile_repair, out, _taken(lse, self.config.write_lse),
            piece_sums, piece_anchors, arrivals,
            tma_q, tma_k, tma_v,
            codes_per_dot, seqlen_k, window, repair_tiles, whole_units, *divisors,
            sQ_layout, sK_layout, sV_layout,
            tiled_mma_qk, tiled_mma_qk_half, tiled_mma_pv,
            SharedStorage,
        ).launch(
            grid=[whole_units + (units - whole_units) * splits, 1, 1],
            block=[WG_THREADS * (1 + CONSUMER_WGS), 1, 1],
            stream=stream,
            min_blocks_per_mp=1,
            **launch_options(),
        )

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        d_q: cute.Tensor,
        d_k: cute.Tensor,
        d_v: cute.Tensor,
        d_k_repair: cute.Tensor,
        tile_repair: cute.Tensor,
        out: cute.Tensor,
        lse: cute.Tensor | None,
        piece_sums: cute.Tensor,
        piece_anchors: cute.Tensor,
        arrivals: cute.Tensor,
        tma_q: cute.CopyAtom,
        tma_k: cute.CopyAtom,
        tma_v: cute.CopyAtom,
        codes_per_dot: Float32,
        seqlen_k: Int32,
        window: Int32,
        repair_tiles: Int32,
        whole_units: Int32,
        n_q_tiles: cute.FastDivmodDivisorV2,
        heads: cute.FastDivmodDivisorV2,
        splits: cute.FastDivmodDivisorV2,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_qk_half: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        follow_previous_launch()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (tma_q, tma_k, tma_v):
                cpasync.prefetch_descriptor(atom)

        storage = SmemAllocator().allocate(SharedStorage)
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        # Consumers release a stage once per warp (one elected lane arrives).
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, CONSUMER_WGS * 4)
        make_pipeline = lambda mbar, n, nbytes: pipeline.PipelineTmaAsync.create(
            barrier_storage=mbar.data_ptr(), num_stages=n, producer_group=producer,
            consumer_group=consumers, tx_count=nbytes, defer_sync=True,
        )
        pipeline_q = make_pipeline(storage.mbar_q, 1, self.bytes_q)
        pipeline_k = make_pipeline(storage.mbar_k, self.config.kv_stages, self.bytes_k)
        pipeline_v = make_pipeline(storage.mbar_v, self.config.kv_stages, self.bytes_v)
        pipeline_init_arrive(is_relaxed=True)

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)

        # Which unit, and which of its pieces: steps [first, first + n_real) of its visiting order.
        n_k = (seqlen_k + TILE_N - 1) // TILE_N
        unit = cute.arch.block_idx()[0]
        piece, n_pieces, first, n_real = Int32(0), Int32(1), Int32(0), n_k
        if unit >= whole_units:
            split_unit, piece = divmod(unit - whole_units, splits)
            unit, n_pieces = whole_units + split_unit, splits.divisor
            first = piece * n_k // splits
            n_real = (piece + 1) * n_k // splits - first
        pair, m_block = divmod(unit, n_q_tiles)
        batch, head = divmod(pair, heads)
        start = n_k - 1
        if const_expr(not self.config.plain_order):
            start = cutlass.min(m_block + window, n_k - 1)
        visit = Visit(first, n_real, start, n_k)
        pipeline_init_wait()

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp_idx == 0:
                self.load(
                    mQ[None, None, head, batch], mK[None, None, head, batch],
                    mV[None, None, head, batch], sQ, sK, sV, tma_q, tma_k, tma_v,
                    pipeline_q, pipeline_k, pipeline_v, m_block, visit, repair_tiles,
                )
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            tidx = cute.arch.thread_idx()[0] - WG_THREADS
            slot = (unit - whole_units) * n_pieces  # the unit's first piece slot, if it is split
            self.consume(
                sQ, sK, sV, d_q[batch, head, None], d_k[batch, head, None], d_v[batch, head],
                d_k_repair[batch, head, None], tile_repair[batch, head, None], out[batch, None, head, None],
                _head_rows(lse, batch, head),
                tiled_mma_qk, tiled_mma_qk_half, tiled_mma_pv,
                pipeline_q, pipeline_k, pipeline_v, tidx, m_block, visit, codes_per_dot, seqlen_k, repair_tiles,
                Piece(piece, n_pieces, slot, piece_sums, piece_anchors, arrivals[unit - whole_units, None],
                      storage.arrivals_seen.get_tensor(cute.make_layout(CONSUMER_WGS))),
            )

    @cute.jit
    def tile_at(self, i: Int32, visit: Visit) -> Int32:
        """The i-th key tile visited: mid-window ``start, ..., 0, n-1, ..., start+1``, or ``i``."""
        j = i
        if const_expr(not self.config.plain_order):
            j = visit.start - i
            if j < 0:
                j = j + visit.n_k
        return j

    @cute.jit
    def piece_visits(self, tile: Int32, visit: Visit) -> cutlass.Boolean:
        """Whether this CTA's steps visit key tile ``tile``: the repair keys of its tokens are this CTA's
        (``split.piece_visits``). The step that visits it is ``tile_at(tile)``: both orders are their own inverse
        (``i -> start - i`` mod n_k, and ``i -> i``)."""
        offset = self.tile_at(tile, visit) - visit.first
        return (offset >= 0) & (offset < visit.n_real)

    @cute.jit
    def kv_index(self, j: Int32, visit: Visit) -> Int32:
        """The K/V tile a CTA's step j loads: its steps of the visiting order, then the repair tiles."""
        tile = visit.n_k + j - visit.n_real
        if j < visit.n_real:
            tile = self.tile_at(visit.first + j, visit)
        return tile

    @cute.jit
    def load(
        self,
        gQ_all: cute.Tensor,
        gK_all: cute.Tensor,
        gV_all: cute.Tensor,
        sQ: cute.Tensor,
        sK: cute.Tensor,
        sV: cute.Tensor,
        tma_q: cute.CopyAtom,
        tma_k: cute.CopyAtom,
        tma_v: cute.CopyAtom,
        pipeline_q: pipeline.PipelineAsync,
        pipeline_k: pipeline.PipelineAsync,
        pipeline_v: pipeline.PipelineAsync,
        m_block: Int32,
        visit: Visit,
        repair_tiles: Int32,
    ):
        """Producer warp: Q once, then K(j + 1) ahead of V(j), the order the consumers wait in; the repair
        tiles (after the real ones in k8 and packed V) come last."""
        gQ = cute.local_tile(gQ_all, (TILE_M, HEAD_DIM), (m_block, 0))
        gK = cute.local_tile(gK_all, (TILE_N, HEAD_DIM), (None, 0))
        gV = cute.local_tile(gV_all, (PV_N, TILE_N), (0, None))
        no_cluster = cute.make_layout(1)
        tQsQ, tQgQ = cpasync.tma_partition(
            tma_q, 0, no_cluster, cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2)
        )
        tKsK, tKgK = cpasync.tma_partition(
            tma_k, 0, no_cluster, cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2)
        )
        tVsV, tVgV = cpasync.tma_partition(
            tma_v, 0, no_cluster, cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2)
        )

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        pipeline_q.producer_acquire(q_state)
        cute.copy(tma_q, tQgQ, tQsQ, tma_bar_ptr=pipeline_q.producer_get_barrier(q_state))

        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.config.kv_stages)
        n_steps = visit.n_real + repair_tiles
        _tma_load(pipeline_k, tma_k, tKgK[None, self.kv_index(0, visit)], tKsK, state)
        for j in cutlass.range(1, n_steps, unroll=1):
            prev = state.clone()
            state.advance()
            _tma_load(pipeline_k, tma_k, tKgK[None, self.kv_index(j, visit)], tKsK, state)
            _tma_load(pipeline_v, tma_v, tVgV[None, self.kv_index(j - 1, visit)], tVsV, prev)
        _tma_load(pipeline_v, tma_v, tVgV[None, self.kv_index(n_steps - 1, visit)], tVsV, state)

    @cute.jit
    def consume(
        self,
        sQ: cute.Tensor,
        sK: cute.Tensor,
        sV: cute.Tensor,
        d_q: cute.Tensor,
        d_k: cute.Tensor,
        d_v: Float32,
        d_k_repair: cute.Tensor,
        tile_repair: cute.Tensor,
        out: cute.Tensor,
        lse: cute.Tensor | None,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_qk_half: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        pipeline_q: pipeline.PipelineAsync,
        pipeline_k: pipeline.PipelineAsync,
        pipeline_v: pipeline.PipelineAsync,
        tidx: Int32,
        m_block: Int32,
        visit: Visit,
        codes_per_dot: Float32,
        seqlen_k: Int32,
        repair_tiles: Int32,
        piece: Piece,
    ):
        """One consumer warpgroup: 64 query rows against the CTA's key tiles and the repair tiles, then the
        epilogue: the output (and ``lse``, the rows' log-sum-exp, where given), or for a piece its sums, and the merge
        if it is the unit's last."""
        wg = cute.arch.make_warp_uniform(tidx // WG_THREADS)
        wg_qk = tiled_mma_qk.get_slice(wg * WG_THREADS)
        wg_pv = tiled_mma_pv.get_slice(wg * WG_THREADS)
        thr_qk = tiled_mma_qk.get_slice(tidx)
        thr_pv = tiled_mma_pv.get_slice(tidx)
        frag_q = wg_qk.make_fragment_A(wg_qk.partition_A(sQ))
        frag_k = wg_qk.make_fragment_B(wg_qk.partition_B(sK))
        wg_qk_half = tiled_mma_qk_half.get_slice(wg * WG_THREADS)
        sK_half = cute.local_tile(sK, (HALF_TILE_N, HEAD_DIM, self.config.kv_stages), (0, 0, 0))
        frag_k_half = wg_qk_half.make_fragment_B(wg_qk_half.partition_B(sK_half))
        frag_v = wg_pv.make_fragment_B(wg_pv.partition_B(sV))
        frag_p = wg_pv.make_fragment_A(wg_pv.partition_shape_A((TILE_M, TILE_N)))
        acc_s = cute.make_rmem_tensor(thr_qk.partition_shape_C((TILE_M, TILE_N)), Float32)
        acc_s_half = cute.make_rmem_tensor(
            tiled_mma_qk_half.get_slice(tidx).partition_shape_C((TILE_M, HALF_TILE_N)), Float32
        )
        # acc_pv: the PV wgmma's accumulator over the last tiles (< promote_every); acc_o: FP32 sum.
        acc_pv = cute.make_rmem_tensor(thr_pv.partition_shape_C((TILE_M, PV_N)), Float32)
        acc_o = cute.make_rmem_tensor_like(acc_pv)
        acc_o.fill(0.0)
        gemms = Gemms(
            tiled_mma_qk, tiled_mma_qk_half, tiled_mma_pv, frag_q, frag_k, frag_k_half, frag_v, frag_p, acc_s,
            acc_s_half, acc_pv,
        )
        key_coords = softmax.rows_view(thr_qk.partition_C(cute.make_identity_tensor((TILE_M, TILE_N))))
        rows = self.softmax_class(acc_s, acc_s_half, key_coords, mul_rn(codes_per_dot, d_q[m_block]))
        last_tile = visit.n_k - 1
        half_last = (repair_tiles > 0) & (d_k_repair.shape[0] < repair_tiles * TILE_N)
        whole_repair_tiles = repair_tiles - Int32(half_last)
        keys = Keys(d_k, d_k_repair, tile_repair, last_tile, seqlen_k - last_tile * TILE_N)

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        pipeline_q.consumer_wait(q_state)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.config.kv_stages)

        tile = self.tile_at(visit.first, visit)
        d_k_tile = d_k[tile]
        pipeline_k.consumer_wait(state)
        gemms.issue_qk(state.index)
        warpgroup.wait_group(0)
        pipeline_k.consumer_release(state)
        rows.online_codes(tile == keys.last_tile, keys.last_valid, d_k_tile, True)
        rows.pack_codes(frag_p, False)

        if const_expr(self.config.pingpong):
            if wg == 0:
                cute.arch.barrier_arrive(barrier_id=NamedBarrier.SCHEDULER, number_of_threads=2 * WG_THREADS)
        step = functools.partial(
            self.step, gemms=gemms, rows=rows, acc_o=acc_o, pipeline_k=pipeline_k, pipeline_v=pipeline_v,
            visit=visit, keys=keys, wg=wg,
        )
        for j in cutlass.range(1, visit.n_real, unroll=1):
            state = step(j, state, False, False)
        for j in cutlass.range(visit.n_real, visit.n_real + whole_repair_tiles, unroll=1):
            state = step(j, state, True, False)
        # The last repair tile as half a tile: a loop of one step or none.
        for j in cutlass.range(visit.n_real + whole_repair_tiles, visit.n_real + repair_tiles, unroll=1):
            state = step(j, state, True, True)

        pipeline_v.consumer_wait(state)
        fresh = (visit.n_real + repair_tiles - 1) % self.config.promote_every == 0
        if half_last:
            gemms.issue_pv(state.index, fresh, True)
        else:
            gemms.issue_pv(state.index, fresh)
        warpgroup.wait_group(0)
        pipeline_v.consumer_release(state)
        rows.promote(acc_o, acc_pv, True)

        if piece.count == 1:
            self.store(acc_o, thr_pv, d_v, out, m_block, rows.anchor, lse)
        else:
            coords = softmax.rows_view(thr_pv.partition_C(cute.make_identity_tensor((TILE_M, PV_N))))
            own = piece.first_slot + piece.index
            pieces.write(acc_o, coords, rows.anchor, piece.sums[own, None, None], piece.anchors[own, None])
            if pieces.arrive(piece.arrivals, piece.seen, wg, tidx % WG_THREADS) == piece.count - 1:
                pieces.merge(acc_o, coords, piece.sums, piece.anchors, piece.first_slot, piece.count, rows.anchor)
                self.store(acc_o, thr_pv, d_v, out, m_block, rows.anchor, lse)

    @cute.jit
    def step(
        self,
        j: Int32,
        state: pipeline.PipelineState,
        repair: cutlass.Constexpr[bool],
        half: cutlass.Constexpr[bool],
        gemms: Gemms,
        rows: softmax.ExpCastSoftmax,
        acc_o: cute.Tensor,
        pipeline_k: pipeline.PipelineAsync,
        pipeline_v: pipeline.PipelineAsync,
        visit: Visit,
        keys: Keys,
        wg: Int32,
    ):
        """Step j: QK^T(j) and PV(j - 1) in flight together, then key tile j's codes on the rows' anchors, then
        PV(j - 1)'s promotion, then the codes packed and checked (where one passed TOP_CODE, the anchor moves).

        A repair tile does not move the anchor: its keys encode on the final grid, each with its own K
        descale, those of tokens in tiles this CTA did not visit (another piece's) to 0. ``half``: a repair tile of
        ``HALF_TILE_N`` keys (the last). ``consume`` binds every argument after ``half`` once, for the whole loop.
        """
        prev = state.clone()
        state.advance()
        if const_expr(repair):
            # Before the wgmmas: the loads' L2 latency passes under them.
            rows.load_repair_keys(keys.d_k_repair, (j - visit.n_real) * TILE_N, half)
        pipeline_k.consumer_wait(state)
        if const_expr(self.config.pingpong):
            cute.arch.barrier(barrier_id=NamedBarrier.SCHEDULER + wg, number_of_threads=2 * WG_THREADS)
        gemms.issue_qk(state.index, half)
        pipeline_v.consumer_wait(prev)
        gemms.issue_pv(prev.index, (j - 1) % self.config.promote_every == 0)
        if const_expr(self.config.pingpong):
            cute.arch.barrier_arrive(barrier_id=NamedBarrier.SCHEDULER + 1 - wg, number_of_threads=2 * WG_THREADS)
        warpgroup.wait_group(1)
        pipeline_k.consumer_release(state)
        if const_expr(repair):
            visits = functools.partial(self.piece_visits, visit=visit)
            first_key = (j - visit.n_real) * TILE_N
            rows.encode_repair(keys.tile_repair, first_key, visits, visit.n_real == visit.n_k, half)
        else:
            tile = self.tile_at(visit.first + j, visit)
            rows.online_codes(tile == keys.last_tile, keys.last_valid, keys.d_k[tile], False)
        # frag_p and acc_pv belong to the PV wgmma until it retires.
        warpgroup.wait_group(0)
        pipeline_v.consumer_release(prev)
        rows.promote(acc_o, gemms.acc_pv, j % self.config.promote_every == 0)
        if const_expr(repair):
            rows.pack_codes(gemms.frag_p, half)
        else:
            rows.pack_codes_checked(gemms.frag_p, gemms.acc_pv)
        return state

    @cute.jit
    def store(
        self,
        acc_o: cute.Tensor,
        thr_pv: cute.ThrMma,
        d_v: Float32,
        out: cute.Tensor,
        m_block: Int32,
        anchor: cute.Tensor,
        lse: cute.Tensor | None,
    ):
        """The query tile's output rows, and ``lse`` where given: ``epilogue.store_rows``."""
        coords = softmax.rows_view(thr_pv.partition_C(cute.make_identity_tensor((TILE_M, PV_N))))
        epilogue.store_rows(acc_o, coords, d_v, out, m_block * TILE_M, anchor, lse)


ForwardArgs = NamedTuple(
    "ForwardArgs",
    [(name, p.annotation) for name, p in inspect.signature(ExpCastAttentionSm90.__call__).parameters.items()
     if name not in ("self", "stream")],
)
"""The kernel's arguments before the stream, in ``__call__``'s order (its signature is their one home): ``ops``
builds them by name, as fake tensors to compile and as torch tensors to call the compiled kernel."""
