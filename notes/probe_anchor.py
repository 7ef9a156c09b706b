"""Device probe: where the codes' anchors sit, and how often they move (kernel only, same process).

  shipped          a first anchor puts the row's top code on 103 or 104 (``expcast.FIRST_ANCHOR_BIAS``, 103.65); a
                   tile with a code above 126 moves the row's anchor so that its top code lands on 112
                   (``expcast.MOVE_CODE``)
  first at 120     the first anchor at ExpCast's own 119.65 (the kernel until 2026-12-04), moves to 112
  first at 96      the first anchor an octave lower than shipped (95.65), moves to 112
  anchors at 96    the first anchor at 95.65, moves to 96

A lower anchor leaves more codes of headroom before a later tile's max passes 126, so fewer warp-tiles take the
rare path (``ExpCastSoftmax.move_anchor``) and hold the other warpgroup at the ping-pong barrier
(``notes/move_rates.py``: on N(0, 1) inputs at 32,760 keys 5.05% of warp-tiles move with the first anchor at 120,
1.03% with it at 104, 0.12% at 96), and leaves the smallest probabilities of the rows that do not move fewer codes
above E4M3's subnormals (a lower move target: those of every moved row too). Only "shipped" is the reference's
semantics; this prints each variant's difference from it, its error against float64 and the time of three rounds
(``variant_runner``). Run on a Hopper GPU: ``python notes/probe_anchor.py``; ``--sass DIR`` dumps each variant's
SASS (no GPU needed). ``tests/test_probes.py`` compiles every variant on the CPU.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32

import variant_runner
from openvc_kernels.expcast import EXPCAST_BIAS, FIRST_ANCHOR_BIAS, MOVE_CODE
from openvc_kernels.sm90 import ptx, softmax

OCTAVE_CODES = 8


def anchored(first_bias: float, move_code: int) -> type[softmax.ExpCastSoftmax]:
    """The shipped softmax with its first anchor ``rne(first_bias - s m)`` and its moves' target ``move_code``."""

    class Anchored(softmax.ExpCastSoftmax):
        @cute.jit
        def first_anchor(self, d_k: Float32):
            for r in cutlass.range_constexpr(2):
                m = ptx.mul_rn(softmax.row_max(self.scores, r), d_k)
                self.anchor[r] = cute.math.roundeven(Float32(first_bias) - ptx.mul_rn(self.s, m))

    Anchored.move_code = move_code
    return Anchored


VARIANTS = {
    "shipped": softmax.ExpCastSoftmax,
    "first at 120": anchored(EXPCAST_BIAS, MOVE_CODE),
    "first at 96": anchored(FIRST_ANCHOR_BIAS - OCTAVE_CODES, MOVE_CODE),
    "anchors at 96": anchored(FIRST_ANCHOR_BIAS - OCTAVE_CODES, MOVE_CODE - 2 * OCTAVE_CODES),
}


def compile_variant(name: str):
    return variant_runner.compile_with_softmax(VARIANTS[name])


if __name__ == "__main__":
    variant_runner.main(__doc__, "probe_anchor")
