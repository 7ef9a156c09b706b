"""One attention processor per model family, each mirroring diffusers' stock one on a shared base."""

from .base import OpenVCProcessorBase
from .cogvideox import CogVideoXOpenVCProcessor
from .hunyuan import HunyuanVideo15OpenVCProcessor, HunyuanVideoOpenVCProcessor
from .ltx import LTXVideoOpenVCProcessor
from .mochi import MochiOpenVCProcessor
from .wan import OpenVCProcessor

__all__ = [
    "CogVideoXOpenVCProcessor",
    "HunyuanVideo15OpenVCProcessor",
    "HunyuanVideoOpenVCProcessor",
    "LTXVideoOpenVCProcessor",
    "MochiOpenVCProcessor",
    "OpenVCProcessor",
    "OpenVCProcessorBase",
]
