"""Programmatic dependent launch (PDL) along the attention call's launches on one stream: the rotation, the
preparation's kernels and the forward kernel.

Each of them is launched with ``use_pdl`` (``launch_options()``), so its CTAs may start while the kernel before it in
the stream still runs its last wave (the launch latency and a CTA's setup overlap it), and each begins with
``follow_previous_launch()``: it waits (``griddepcontrol.wait``) until the kernel before it has completed and its
writes are visible, as without PDL, then lets the launch after it start early (``griddepcontrol.launch_dependents``).
The rule every such kernel keeps: nothing before that call loads or stores global memory (a store could race with
the kernel before it still reading a buffer the caching allocator gave out again). A kernel before it that does not
take part (any torch kernel) lets it start only once it has finished.

A kernel that reads nothing the launches before it in the call write (Q's quantization: ``prep.QuantizePerBlock``
with ``beside_previous``) need not wait to start: it lets the launch after it start at once
(``start_beside_previous_launch``) and runs beside the kernel before it, while that one's last CTAs still run (the
tokens' choice, on a few SMs); only its last CTA waits for that kernel, before it exits
(``complete_after_previous_launch``), so that it still completes after it, and every later launch's wait still covers
every launch before it. Its rule: the kernel before it follows ``follow_previous_launch`` (so that everything before
that one has completed, and what those launches wrote may be read: ``sm90.rotary_quant.RotaryQuantizeQK`` reads K's
mean from a launch before that one), and its outputs were allocated before that kernel was launched (so that no
buffer it stores into can be one the kernel before it still uses).
"""

import cutlass
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


@cute.jit
def start_beside_previous_launch():
    """Let the launch after this one start, without waiting for the one before it (see the module: its rule)."""
    if const_expr(ENABLED):
        cute.arch.griddepcontrol_launch_dependents()


@cute.jit
def complete_after_previous_launch(last_cta: cutlass.Boolean):
    """In the kernel's last CTA (``last_cta``), after its work: wait for the launch before this one, so that this one
    completes after it (``start_beside_previous_launch``'s other half)."""
    if const_expr(ENABLED):
        if last_cta:
            cute.arch.griddepcontrol_wait()
