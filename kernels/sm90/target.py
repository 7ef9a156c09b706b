"""Compiling the sm90 kernels on any machine, with or without a GPU: the target, and the fake tensors that stand for
the arguments at compile time (shapes symbolic, so one compiled kernel serves every shape)."""

import os

ARCH = "sm_90a"
ARCH_ENV = "CUTE_DSL_ARCH"


def default_to_sm90() -> None:
    """Compile for sm_90a unless ``CUTE_DSL_ARCH`` says otherwise: without a GPU the DSL has no device to ask."""
    os.environ.setdefault(ARCH_ENV, ARCH)


def row_major_fake(dtype, shape: tuple, align: int):
    """A compact row-major fake tensor of ``dtype`` (a cutlass numeric type), its base aligned to ``align`` bytes."""
    import cutlass.cute as cute

    order = tuple(reversed(range(len(shape))))
    return cute.runtime.make_fake_compact_tensor(dtype, shape, stride_order=order, assumed_align=align)

