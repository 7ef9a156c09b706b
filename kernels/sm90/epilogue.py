"""The forward kernel's output: each row's O normalised by its sum l, rounded to bf16, stored 16 bytes at a time.

Of each of its two rows a consumer thread holds the accumulator columns ``8 c + 2 t + e`` (``softmax.rows_view``;
t = lane % 4, its place in the quad that holds the row; e = 0, 1; c = 0..15 for the 128 outputs, 16 for the ones
rows' sum l). Rounded to bf16, a thread's word c (two outputs) and the same word of the quad's three other lanes are
the 16 bytes of outputs ``8 c .. 8 c + 7``. Stored as they are, a warp's store covers 8 rows x 16 bytes, half a
32-byte sector each; the quad first trades words (``quad_transpose``), so that of each group of four chunks
``4 m .. 4 m + 3`` lane t holds chunk ``4 m + t`` whole: 8 stores of 16 bytes a thread, each of a warp's stores 8 rows
x 64 bytes in whole sectors.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32, const_expr

from .softmax import row_lse, rows_view

QUAD = 4
"""Lanes that hold one accumulator row."""
CHUNK_WORDS = 4
"""bf16 pairs in a 16-byte store: one from each lane of the quad."""


@cute.jit
def quad_transpose(words: list, place: Int32) -> list:
    """``words[j]`` of the lane at ``place`` in its quad becomes the quad's lane j's ``words[place]`` (j, place in
    0..3). Two exchanges, at lane distance 2 then 1: of each pair of words whose indices differ in that distance's
    bit, the lane sends the one where that bit differs from its place's and takes the partner's in its stead."""
    words = list(words)
    for distance in (2, 1):
        high = (place & distance) != 0
        for a in [a for a in range(CHUNK_WORDS) if not a & distance]:
            b = a | distance
            sent = Uint32(cutlass.select_(high, words[a], words[b]))
            got = Uint32(cute.arch.shuffle_sync_bfly(sent, offset=distance))
            words[a] = Uint32(cutlass.select_(high, got, words[a]))
            words[b] = Uint32(cutlass.select_(high, words[b], got))
    return words


@cute.jit
def store_rows(
    acc_o: cute.Tensor, coords: cute.Tensor, d_v: Float32, out: cute.Tensor, first_row: Int32, anchor: cute.Tensor,
    lse: cute.Tensor | None,
):
    """``O = fp32(acc * fp32(d_v / l))`` -> bf16 rows < S of ``out`` (S, 128); ``coords``: the (row, column) of each
    of ``acc_o``'s values (its rows view), rows counted from ``first_row``. Where given, ``lse`` (S,) receives each
    row's ``row_lse(l, anchor)``, ``anchor`` the rows' final grid, plus ``d_v - d_v``: NaN for a head with a
    non-finite input as its output (``quant.poison_non_finite``). Every lane runs the exchanges (full-warp
    shuffles); the rows past S store nothing."""
    rows = rows_view(acc_o)
    l_column = cute.size(rows, mode=[1]) - 2  # (e = 0, last column group): column 128 + 2 lane
    seq_len = out.shape[0]
    place = cute.arch.lane_idx() % QUAD
    for r in cutlass.range_constexpr(2):
        scale = d_v / rows[r, l_column]
        row = first_row + coords[r, 0][0]
        outputs = cute.make_rmem_tensor((l_column,), cutlass.BFloat16)
        for i in cutlass.range_constexpr(l_column):
            outputs[i] = (rows[r, i] * scale).to(cutlass.BFloat16)
        words = cute.recast_tensor(outputs, Uint32)
        for m in cutlass.range_constexpr(cute.size(words) // CHUNK_WORDS):
            chunk = quad_transpose([words[CHUNK_WORDS * m + j] for j in range(CHUNK_WORDS)], place)
            staged = cute.make_rmem_tensor((CHUNK_WORDS,), Uint32)
            for j in cutlass.range_constexpr(CHUNK_WORDS):
                staged[j] = chunk[j]
            if row < seq_len:
                row_words = cute.recast_tensor(out[row, None], Uint32)
                cute.autovec_copy(staged, cute.local_tile(row_words, (CHUNK_WORDS,), (CHUNK_WORDS * m + place,)))
        if const_expr(lse is not None):
            if row < seq_len:
                if place == 0:  # a quad's four lanes hold the row: its first writes
                    lse[row] = row_lse(rows[r, l_column], anchor[r]) + (d_v - d_v)
