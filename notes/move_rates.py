"""CPU model: how often a row's anchor moves (semantics item 4), per key tile, at the bench's sequence lengths.

A row's first key tile sets its anchor (``expcast.code_anchor``); every later tile is encoded on the anchor as it
stands, and where its top code passes TOP_CODE the anchor moves down by ``expcast.code_shift`` (the kernel's
``move_anchor``, a pass over the warp's codes and PV sums more). The kernel takes that path per warp (16 rows) and
key tile where any of its rows moves, so this counts warp-tiles with a move, for N(0, 1) q and k (head dim 128,
softmax scale 1/sqrt(128); real-valued scores, no quantization), with the first anchor at 119.65 (ExpCast's own, the
kernel's until 2026-12-04), 111.65 and 103.65 (``expcast.FIRST_ANCHOR_BIAS``, shipped). Prints one line per S and
first anchor:

    python notes/move_rates.py [ROWS]
"""

import sys

import torch

from openvc_kernels.expcast import CODE_UNIT, EXPCAST_BIAS, FIRST_ANCHOR_BIAS, code_anchor, code_shift, codes_per_dot
from openvc_kernels.quant import BLOCK

HEAD_DIM = 128
WARP_ROWS = 16
SEQ_LENS = (4096, 32_760, 75_600, 118_800)


def warp_tiles_moved(seq: int, rows: int, first_bias: float, generator: torch.Generator) -> tuple[float, float]:
    """Moves per row over the whole key range, and the share of warp-tiles (after the first tile) with a move."""
    s = codes_per_dot(HEAD_DIM**-0.5)
    q = torch.randn(rows, HEAD_DIM, generator=generator)
    anchor, moves = None, []
    for start in range(0, seq, BLOCK):
        k = torch.randn(min(BLOCK, seq - start), HEAD_DIM, generator=generator)
        dots = q @ k.T
        if anchor is None:
            anchor = code_anchor(dots.amax(dim=-1), s) + (first_bias - FIRST_ANCHOR_BIAS)
            continue
        shift = code_shift((s * dots + anchor[:, None]) * CODE_UNIT)
        anchor = anchor - shift
        moves.append(shift > 0)
    moved = torch.stack(moves, dim=-1)  # (rows, tiles - 1)
    per_warp = moved.reshape(rows // WARP_ROWS, WARP_ROWS, -1).any(dim=1)
    return moved.sum(dim=-1).float().mean().item(), per_warp.float().mean().item()


def main() -> None:
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    generator = torch.Generator().manual_seed(0)
    for seq in SEQ_LENS:
        for first_bias in (EXPCAST_BIAS, EXPCAST_BIAS - 8, FIRST_ANCHOR_BIAS):
            per_row, share = warp_tiles_moved(seq, rows, first_bias, generator)
            print(f"S = {seq:7,d}, first anchor {first_bias:6.2f}: {per_row:.2f} moves per row, "
                  f"{share:6.2%} of warp-tiles with a move", flush=True)


if __name__ == "__main__":
    main()
