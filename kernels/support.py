"""Whether the Hopper kernel can take a call: one place that names every requirement, and the errors that say
what is missing and how to get it."""

import functools
import importlib

import torch

HEAD_DIM = 128
KERNEL_DTYPES = (torch.float16, torch.bfloat16)
HOPPER = (9, 0)

REINSTALL = "reinstall openvc-diffusers (`pip install openvc-diffusers`, or `pip install -e .` in a checkout)"
KERNEL_PACKAGES = (
    ("cutlass", "nvidia-cutlass-dsl[cu13]==4.8.1"),
    ("tvm_ffi", "apache-tvm-ffi"),
)
"""(module, the requirement that provides it): what compiling and calling the kernels imports."""


class KernelUnavailableError(RuntimeError):
    """The FP8 kernel cannot be built or loaded here; the message names the cause and the fix."""


def kernel_unavailable_reason(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """None if the sm90 kernel can run attention on queries of this device, dtype and head dim; else why not
    (for an input it cannot take, or a package this environment lacks: ``missing_package_reason``)."""
    reason = input_unsupported_reason(device, dtype, head_dim)
    return reason if reason is not None else missing_package_reason()


def input_unsupported_reason(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    if device.type != "cuda":
        return f"the FP8 kernel runs on CUDA devices, inputs are on {device}"
    capability = _capability(device.index if device.index is not None else torch.cuda.current_device())
    if capability != HOPPER:
        name = torch.cuda.get_device_name(device)
        return f"the FP8 kernel is built for Hopper (sm_90a); {name} is sm_{capability[0]}{capability[1]}"
    if head_dim != HEAD_DIM:
        return f"the FP8 kernel takes head_dim {HEAD_DIM}, got {head_dim}"
    if dtype not in KERNEL_DTYPES:
        return f"the FP8 kernel takes fp16/bf16 inputs, got {dtype}"
    return None


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    """The compute capability of a CUDA device, asked once rather than on every call (host time)."""
    return torch.cuda.get_device_capability(device_index)


@functools.cache
def missing_package_reason() -> str | None:
    """Why the packages the kernels import cannot be imported here (not installed, or the DSL's CUDA flavor does
    not match the driver), with the fix; None when they import."""
    for module, requirement in KERNEL_PACKAGES:
        try:
            importlib.import_module(module)
        except Exception as error:  # ImportError, or the DSL's RuntimeError for a driver older than its flavor
            cause = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            return (
                f"the FP8 kernel cannot be built: {requirement} does not import ({cause}); "
                f"fix: `pip install '{requirement}'` or {REINSTALL}"
            )
    return None
