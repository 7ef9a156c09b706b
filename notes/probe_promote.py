"""Device probe: how many key tiles the PV wgmma sums before its sum moves into FP32 (kernel only, same process).

  every 8 (shipped)  ``ForwardConfig.promote_every`` = ``wgmma.PV_PROMOTE_EVERY`` = 8: per consumer thread 68 FFMA
                     every 8th tile (``ExpCastSoftmax.promote``); the wgmma's 14-bit sums run over 1,024 keys
  every 4            twice the promotions' FFMAs, sums over 512 keys
  every 16           a quarter of them, over 2,048 keys

The kernel is bound by its consumer warps' instruction issue (notes/kernel.md), so each FFMA a tile saves could count;
the longer chains drop more small products (``reference_attention(..., accumulation="wgmma", promote_every=)`` models
them). Only "every 8" is the reference's default semantics; this prints each variant's difference from it, its error
against float64 and the time of three rounds (``variant_runner``). Run on a Hopper GPU: ``python
notes/probe_promote.py``; ``--sass DIR`` dumps each variant's SASS (no GPU needed). ``tests/test_probes.py`` compiles
every variant on the CPU.
"""

import variant_runner
from openvc_kernels.sm90 import softmax
from openvc_kernels.sm90.config import ForwardConfig

VARIANTS = {
    "every 8 (shipped)": ForwardConfig(),
    "every 4": ForwardConfig(promote_every=4),
    "every 16": ForwardConfig(promote_every=16),
}


def compile_variant(name: str):
    return variant_runner.compile_with_softmax(softmax.ExpCastSoftmax, VARIANTS[name])


if __name__ == "__main__":
    variant_runner.main(__doc__, "probe_promote")
