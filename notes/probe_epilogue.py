"""Device probe: what the forward kernel's output stores cost (kernel only, same process).

  shipped          each thread stores its two rows' 64 outputs as 32 four-byte words, as it holds them: a warp's store
                   covers 8 rows x 16 bytes, half a 32-byte sector each
  quad 16B stores  the four lanes of a quad first trade words (a 4 x 4 transpose by two butterfly exchanges), so that
                   each lane holds 8 consecutive outputs of its row: 8 sixteen-byte stores a thread, a warp's store
                   covering 8 rows x 64 bytes in whole sectors; the same bytes as shipped (branch ``quad-stores``
                   built it into the kernel; not merged, notes/kernel.md)
  no output        the stores skipped (only where d_v < 0, never): the bound on what any epilogue could win; its
                   output stays the NaN the runner fills it with

Run on a Hopper GPU: ``python notes/probe_epilogue.py``; ``--sass DIR`` dumps each variant's SASS (no GPU needed).
``tests/test_probes.py`` compiles every variant on the CPU.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32, const_expr

import variant_runner
from openvc_kernels.sm90 import softmax
from openvc_kernels.sm90.fwd import TILE_M, ExpCastAttentionSm90
from openvc_kernels.sm90.layout import PV_N

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


class QuadStores(ExpCastAttentionSm90):
    @cute.jit
    def store(self, acc_o, thr_pv, d_v: Float32, out, m_block, anchor, lse):
        rows = softmax.rows_view(acc_o)
        coords = softmax.rows_view(thr_pv.partition_C(cute.make_identity_tensor((TILE_M, PV_N))))
        l_column = cute.size(rows, mode=[1]) - 2
        seq_len = out.shape[0]
        place = cute.arch.lane_idx() % QUAD
        for r in cutlass.range_constexpr(2):
            scale = d_v / rows[r, l_column]
            row = m_block * TILE_M + coords[r, 0][0]
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
                    # The row's outputs 8 (4 m + place) .. + 7.
                    row_words = cute.recast_tensor(out[row, None], Uint32)
                    cute.autovec_copy(staged, cute.local_tile(row_words, (CHUNK_WORDS,), (CHUNK_WORDS * m + place,)))
            if const_expr(lse is not None):
                if row < seq_len:
                    if place == 0:
                        lse[row] = softmax.row_lse(rows[r, l_column], anchor[r]) + (d_v - d_v)


class NoOutput(ExpCastAttentionSm90):
    @cute.jit
    def store(self, acc_o, thr_pv, d_v: Float32, out, m_block, anchor, lse):
        if d_v < Float32(0.0):
            ExpCastAttentionSm90.store(self, acc_o, thr_pv, d_v, out, m_block, anchor, lse)


VARIANTS = {
    "shipped": ExpCastAttentionSm90,
    "quad 16B stores": QuadStores,
    "no output": NoOutput,
}


def compile_variant(name: str):
    from openvc_kernels.ops import compile_attention
    from openvc_kernels.sm90.config import ForwardConfig

    return compile_attention(ForwardConfig(), VARIANTS[name])


if __name__ == "__main__":
    variant_runner.main(__doc__, "probe_epilogue")
