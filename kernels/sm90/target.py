"""Compiling the sm90 kernels on any machine, with or without a GPU: the target, and the fake tensors that stand for
the arguments at compile time (shapes symbolic, so one compiled kernel serves every shape)."""

ARCH = "sm_90a"
COMPILE_OPTIONS = f"--enable-tvm-ffi --gpu-arch {ARCH}"
"""``cute.compile`` options of every kernel here: TVM-FFI calls, and the target named, not read from
``CUTE_DSL_ARCH`` (the DSL reads that variable once, when first imported, and asks the GPU where there is one)."""


def row_major_fake(dtype, shape: tuple, align: int):
    """A compact row-major fake tensor of ``dtype`` (a cutlass numeric type), its base aligned to ``align`` bytes."""
    import cutlass.cute as cute

    order = tuple(reversed(range(len(shape))))
    return cute.runtime.make_fake_compact_tensor(dtype, shape, stride_order=order, assumed_align=align)

