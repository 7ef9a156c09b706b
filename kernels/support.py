"""Whether the Hopper kernel can take a call: one place that names every requirement."""

import functools
import importlib.util

import torch

HEAD_DIM = 128
KERNEL_DTYPES = (torch.float16, torch.bfloat16)
HOPPER = (9, 0)


@functools.cache
def cutlass_dsl_installed() -> bool:
    return importlib.util.find_spec("cutlass") is not None


def kernel_unavailable_reason(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """None if the sm90 kernel can run attention on queries of this device, dtype and head dim; else why not."""
    if device.type != "cuda":
        return f"the FP8 kernel runs on CUDA devices, inputs are on {device}"
    capability = torch.cuda.get_device_capability(device)
    if capability != HOPPER:
        name = torch.cuda.get_device_name(device)
        return f"the FP8 kernel is built for Hopper (sm_90a); {name} is sm_{capability[0]}{capability[1]}"
    if head_dim != HEAD_DIM:
        return f"the FP8 kernel takes head_dim {HEAD_DIM}, got {head_dim}"
    if dtype not in KERNEL_DTYPES:
        return f"the FP8 kernel takes fp16/bf16 inputs, got {dtype}"
    if not cutlass_dsl_installed():
        return "nvidia-cutlass-dsl is not installed"
    return None
