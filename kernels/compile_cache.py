"""Compiled kernels, cached in memory and on disk, so the CuTe DSL compile is paid once per machine.

A kernel variant is compiled to an object file (``export_to_c``) in ``$OPENVC_KERNEL_CACHE`` (default
``~/.cache/openvc-diffusers/kernels``) under a name that covers the variant, this package's sources, the
target architecture and the cutlass-dsl version: editing a kernel or upgrading the DSL compiles afresh. Later
processes load the file (``cute.runtime.load_module``: milliseconds instead of seconds). Files are written to
a temporary name and renamed, so processes started together (torchrun) never read half a file.
"""

import functools
import hashlib
import importlib.metadata
import logging
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Callable

from .sm90.target import ARCH
from .support import REINSTALL, KernelUnavailableError, missing_package_reason

CACHE_ENV = "OPENVC_KERNEL_CACHE"

logger = logging.getLogger(__name__)
_loaded: dict[str, Callable] = {}


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "openvc-diffusers" / "kernels")


@functools.cache
def _build_digest() -> str:
    """What a compiled kernel depends on besides its variant: DSL version and CUDA flavor (the DSL loads the newest
    the driver supports, so one cache folder can see both), target, every source file here."""
    try:
        dsl_version = importlib.metadata.version("nvidia-cutlass-dsl")
    except importlib.metadata.PackageNotFoundError:
        dsl_version = "unknown"
    digest = hashlib.sha256(f"{dsl_version} {dsl_flavor()} {ARCH}".encode())
    root = Path(__file__).parent
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def dsl_flavor() -> str:
    """The file name of the DSL extension module that loaded (one per CUDA flavor, e.g. ``_cutlass_ir.cu13...so``)."""
    import cutlass  # noqa: F401  (loads the flavor's module)

    return Path(sys.modules["cutlass._mlir._mlir_libs._cutlass_ir"].__file__).name


def kernel_path(name: str) -> Path:
    return cache_dir() / f"{name}-{_build_digest()}.o"


def load_or_compile(name: str, compile_fn: Callable[[], Callable]) -> Callable:
    """The kernel variant ``name`` (letters, digits, underscores) from memory, from disk, or ``compile_fn()``.

    ``compile_fn`` returns a ``cute.compile(..., options=COMPILE_OPTIONS)`` result; the loaded and the
    compiled kernel take the same arguments. A cache that cannot be read or written costs a compile, never
    a failure; a missing package or a failed compile raises ``KernelUnavailableError`` naming cause and fix.
    """
    if name in _loaded:
        return _loaded[name]
    missing = missing_package_reason()
    if missing is not None:
        raise KernelUnavailableError(missing)
    import cutlass.cute as cute

    path, symbol = kernel_path(name), f"openvc_{name}"
    kernel = None
    if path.exists():
        try:
            kernel = getattr(cute.runtime.load_module(str(path), enable_tvm_ffi=True), symbol)
        except Exception as error:  # a truncated or foreign file: compile and replace it
            logger.warning("openvc: recompiling %s, the cached %s did not load (%s)", name, path, error)
    if kernel is None:
        try:
            kernel = compile_fn()
        except Exception as error:
            raise KernelUnavailableError(
                f"the FP8 kernel {name} failed to compile: {_first_line(error)}; fix: {REINSTALL} with its pinned "
                "nvidia-cutlass-dsl[cu13] and apache-tvm-ffi, and report the chained error if that does not help"
            ) from error
        _export(kernel, path, symbol)
    _loaded[name] = kernel
    return kernel


def _first_line(error: Exception) -> str:
    """The first line of an error's message, without the DSL's terminal colours."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error)).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def _export(kernel, path: Path, symbol: str) -> None:
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, name = tempfile.mkstemp(dir=path.parent, suffix=".o.tmp")
        os.close(handle)
        temporary = Path(name)
        kernel.export_to_c(str(temporary), function_name=symbol)
        os.replace(temporary, path)
    except OSError as error:
        logger.warning("openvc: compiled kernels stay in memory, %s is not writable (%s)", path.parent, error)
    finally:
        if temporary is not None and temporary.exists():
            temporary.unlink()
