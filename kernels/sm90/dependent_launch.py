"""Programmatic dependent launch (PDL) along the attention call's launches on one stream: the rotation, the
preparation's kernels and the forward kernel.

Each of them is launched with ``use_pdl`` (``launch_options()``), so its CTAs may start while the kernel before it in
the stream still runs its last wave (the launch latency and a CTA's setup overlap it), and each begins with
``follow_previous_launch()``: it waits (``griddepcontrol.wait``) until the kernel before it has completed and its
writes are visible, as without PDL, then lets the launch after it start early (``griddepcontrol.launch_dependents``).
The rule every such kernel keeps: nothing before that call loads or stores global memory (a store could race with
the kernel before it still reading a buffer the caching allocator gave out again). A kernel before it that does not
take part (any torch kernel) lets it start only once it has finished.

The repair tokens' choice (``sm90.select``) runs on a stream of its own after an event: it is launched as usual.
"""

import cutlass.cute as cute
from cutlass import const_expr

ENABLED = True
"""Read when a kernel is compiled: ``notes/probe_dependent_launch.py`` compiles every kernel both ways."""


def launch_options() -> dict:
    """The ``launch`` keywords of a kernel that follows ``follow_previous_launch``'s rule."""
    return {"use_pdl": ENABLED}


@cute.jit
def follow_previous_launch():
    """Wait for the kernel before this one in the stream, then let the one after it start (see the module)."""
    if const_expr(ENABLED):
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
