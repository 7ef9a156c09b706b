"""The repair keys' K descales and tokens' tiles, brought into L1 a repair tile ahead of the tile that reads them.

A repair tile's keys come from any block, so its softmax loads each key's own d_k (and, in a piece of a split unit,
its token's tile): 32 values of each per consumer thread and tile. Missing L1, those loads keep the warpgroup
waiting on L2 between its wgmmas, with the tensor cores idle. A prefetch holds no register while in flight (staged
in shared memory instead, the reads of the copy cost ptxas registers it does not have: the kernel spilled).

Thread i of a consumer warpgroup prefetches the lines of key i of the tile (a tile's 128 keys: 512 bytes of
descales and 512 of tiles), the first repair tile's before the key tiles' loop, each next one's at the top of the
repair tile before it.
"""

from typing import NamedTuple

import cutlass.cute as cute
from cutlass import Int32

from ..quant import BLOCK


class RepairKeys(NamedTuple):
    """One consumer thread's view of the repair keys: the head's descales ``d_k`` and tokens' tiles ``tiles`` (R,)
    in global memory, how many repair tiles the CTA visits (``count``) and this thread's index in its warpgroup
    (``thread``)."""

    d_k: cute.Tensor
    tiles: cute.Tensor
    count: Int32
    thread: Int32

    @cute.jit
    def prefetch(self, tile: Int32):
        """Start bringing repair tile ``tile``'s lines into L1 (this thread's key), if the CTA visits that tile."""
        if tile < self.count:
            key = tile * BLOCK + self.thread
            cute.arch.prefetch((self.d_k.iterator + key).llvm_ptr, cache_level="L1")
            cute.arch.prefetch((self.tiles.iterator + key).llvm_ptr, cache_level="L1")

    def of_tile(self, tile: Int32) -> tuple[cute.Tensor, cute.Tensor]:
        """Repair tile ``tile``'s descales and tokens' tiles, (BLOCK,) views of ``d_k`` and ``tiles``."""
        keys = cute.make_layout(BLOCK)
        first = tile * BLOCK
        return cute.make_tensor(self.d_k.iterator + first, keys), cute.make_tensor(self.tiles.iterator + first, keys)
