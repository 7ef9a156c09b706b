"""The tail split's pieces (``kernels/split.py``): write a piece's sums, count the pieces in, merge them.

Workspace (global, FP32, one slot per piece, the pieces of a unit in consecutive slots):
  piece_sums    (slots, 128 rows, 136)  a piece's unnormalised O and, in columns 128..135, l (the ones rows)
  piece_anchors (slots, 128 rows)       the row's final anchor in that piece
  arrivals      (split units, 2) int32  pieces of the unit whose consumer warpgroup w has written; zero at launch

Each consumer warpgroup (64 rows) runs the protocol on its own: write its rows, release them (fence), one thread
counts the warpgroup in; the warpgroup that counts last acquires the others' rows and merges all pieces in
piece order, so the result does not depend on which piece finished last.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ..expcast import LOG2_PER_CODE
from .barriers import NamedBarrier
from .softmax import rows_view


@cute.jit
def write(acc_o: cute.Tensor, coords: cute.Tensor, anchor: cute.Tensor, sums: cute.Tensor, anchors: cute.Tensor):
    """This thread's rows of the piece: every accumulator column (l included) to ``sums`` (128, 136) and the
    rows' anchors to ``anchors`` (128,), written by the quad's first lane."""
    rows = rows_view(acc_o)
    for r in cutlass.range_constexpr(2):
        row = coords[r, 0][0]
        for i in cutlass.range_constexpr(cute.size(rows, mode=[1])):
            sums[row, coords[r, i][1]] = rows[r, i]
        if coords[r, 0][1] == 0:
            anchors[row] = anchor[r]


@cute.jit
def arrive(arrivals: cute.Tensor, seen: cute.Tensor, wg: Int32, thread_in_wg: Int32) -> Int32:
    """Count this warpgroup's piece in (``arrivals``: the unit's two counters) after its writes; returns how many
    pieces had counted in before it, the same in every thread of the warpgroup (``seen``: one shared Int32 per
    warpgroup)."""
    cute.arch.fence_acq_rel_gpu()  # release this thread's writes before the count that publishes them
    cute.arch.barrier(barrier_id=NamedBarrier.MERGE + wg, number_of_threads=128)
    if thread_in_wg == 0:
        counter = arrivals.iterator + cute.crd2idx(wg, arrivals.layout)
        seen[wg] = cute.arch.atomic_add(counter, Int32(1), sem="acq_rel", scope="gpu")
    cute.arch.barrier(barrier_id=NamedBarrier.MERGE + wg, number_of_threads=128)
    return seen[wg]


@cute.jit
def merge(
    acc_o: cute.Tensor,
    coords: cute.Tensor,
    sums: cute.Tensor,
    anchors: cute.Tensor,
    slot: Int32,
    pieces: Int32,
    anchor: cute.Tensor,
):
    """``acc_o`` = the unit's sums from its ``pieces`` slots from ``slot`` on in ``sums`` (slots, 128, 136) and
    ``anchors`` (slots, 128): on the lowest anchor (the highest max), ``fma(2^((anchor - anchor_p) / 8), sums_p, ...)``
    from 0 in piece order (``split.merge_pieces``); ``anchor`` (this thread's two rows) receives that lowest anchor,
    the grid the merged sums sit on."""
    cute.arch.fence_acq_rel_gpu()  # acquire the other pieces' writes, published by their counts
    rows = rows_view(acc_o)
    for r in cutlass.range_constexpr(2):
        row = coords[r, 0][0]
        lowest = anchors[slot, row]
        for p in cutlass.range(slot + 1, slot + pieces, unroll=1):
            lowest = cute.arch.fmin(lowest, anchors[p, row])
        anchor[r] = lowest
        for i in cutlass.range_constexpr(cute.size(rows, mode=[1])):
            rows[r, i] = Float32(0.0)
        for p in cutlass.range(slot, slot + pieces, unroll=1):
            factor = cute.math.exp2((lowest - anchors[p, row]) * LOG2_PER_CODE, fastmath=True)
            for i in cutlass.range_constexpr(cute.size(rows, mode=[1])):
                rows[r, i] = cute.math.fma(factor, sums[p, row, coords[r, i][1]], rows[r, i])
