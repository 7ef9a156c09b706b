"""One attention processor per model family."""

from .wan import OpenVCProcessor

__all__ = ["OpenVCProcessor"]
