"""Device probe: what the forward kernel's output stores cost (kernel only, same process).

  shipped          ``epilogue.store_rows``: the four lanes of a quad first trade words (a 4 x 4 transpose by two
                   butterfly exchanges), so that each lane holds 8 consecutive outputs of its row: 8 sixteen-byte
                   stores a thread, a warp's store covering 8 rows x 64 bytes in whole 32-byte sectors
  4-byte stores    the kernel's stores until 2026-12-05: each thread stores its two rows' 64 outputs as 32 four-byte
                   words, as it holds them; a warp's store covers 8 rows x 16 bytes, half a sector each
  no output        the stores skipped (only where d_v < 0, never): the bound on what any epilogue could win; its
                   output stays the NaN the runner fills it with

The first two write the same bytes. Run on a Hopper GPU: ``python notes/probe_epilogue.py``; ``--sass DIR`` dumps
each variant's SASS (no GPU needed). ``tests/test_probes.py`` compiles every variant on the CPU.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

import variant_runner
from openvc_kernels.sm90 import softmax
from openvc_kernels.sm90.fwd import TILE_M, ExpCastAttentionSm90
from openvc_kernels.sm90.layout import PV_N


class WordStores(ExpCastAttentionSm90):
    @cute.jit
    def store(self, acc_o, thr_pv, d_v: Float32, out, m_block, anchor, lse):
        rows = softmax.rows_view(acc_o)
        coords = softmax.rows_view(thr_pv.partition_C(cute.make_identity_tensor((TILE_M, PV_N))))
        l_column = cute.size(rows, mode=[1]) - 2
        seq_len = out.shape[0]
        for r in cutlass.range_constexpr(2):
            scale = d_v / rows[r, l_column]
            row = m_block * TILE_M + coords[r, 0][0]
            if row < seq_len:
                for i in cutlass.range_constexpr(l_column):
                    out[row, coords[r, i][1]] = (rows[r, i] * scale).to(cutlass.BFloat16)
                if const_expr(lse is not None):
                    if coords[r, 0][1] == 0:
                        lse[row] = softmax.row_lse(rows[r, l_column], anchor[r]) + (d_v - d_v)


class NoOutput(ExpCastAttentionSm90):
    @cute.jit
    def store(self, acc_o, thr_pv, d_v: Float32, out, m_block, anchor, lse):
        if d_v < Float32(0.0):
            ExpCastAttentionSm90.store(self, acc_o, thr_pv, d_v, out, m_block, anchor, lse)


VARIANTS = {
    "shipped": ExpCastAttentionSm90,
    "4-byte stores": WordStores,
    "no output": NoOutput,
}


def compile_variant(name: str):
    from openvc_kernels.ops import compile_attention
    from openvc_kernels.sm90.config import ForwardConfig

    return compile_attention(ForwardConfig(), VARIANTS[name])


if __name__ == "__main__":
    variant_runner.main(__doc__, "probe_epilogue")
