"""Open-VC FP8 ExpCast attention for diffusers video transformers.

``model.set_attention_backend("openvc")`` (the backend is registered on import), or
``pipe.transformer.set_attn_processor(OpenVCProcessor(config))``, or ``openvc_diffusers.apply(pipe, config)``.
"""

from .apply import apply
from .attention import attention
from .backend import register
from .config import ConfigError, OpenVCConfig, load_config
from .processors import OpenVCProcessor

register()

__all__ = ["ConfigError", "OpenVCConfig", "OpenVCProcessor", "apply", "attention", "load_config", "register"]
