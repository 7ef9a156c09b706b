"""Named barrier ids of the forward kernel, in one place so that no two roles share one by accident.

Barrier 0 is ``__syncthreads`` (``bar.sync 0``). Each pair below belongs to the two consumer warpgroups: warpgroup w
(0 or 1) uses the pair's first id plus w.
"""

import enum


class NamedBarrier(enum.IntEnum):
    SCHEDULER = 1
    """1, 2: ping-pong; consumer warpgroup w waits on 1 + w for its turn to issue wgmmas, the other arrives on it."""
    MERGE = 3
    """3, 4: the tail split's merge; consumer warpgroup w syncs its 128 threads on 3 + w (``pieces.arrive``)."""
