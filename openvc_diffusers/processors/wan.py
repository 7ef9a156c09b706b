"""Open-VC for Wan-style attention: Wan 2.1/2.2 (T2V, I2V, TI2V), SkyReels-V2, and any model whose processor has
``WanAttnProcessor``'s signature (rotary embeddings, QK norms, I2V image context)."""

import torch
from diffusers.models.transformers.transformer_skyreels_v2 import SkyReelsV2AttnProcessor
from diffusers.models.transformers.transformer_wan import WanAttnProcessor

from .base import OpenVCProcessorBase, eager_inference


class OpenVCProcessor(OpenVCProcessorBase, WanAttnProcessor):
    """Attention processor that sends Wan self-attention to Open-VC FP8 attention, by policy.

    ``pipe.transformer.set_attn_processor(OpenVCProcessor(config))``: ``config`` is anything
    ``openvc_diffusers.load_config`` takes (None for the defaults, a dict, a YAML path, a config).
    diffusers' own ``WanAttnProcessor`` with its attention calls routed through the "openvc" backend, which also
    applies the rotary embedding in inference (``backend_rotates``, the same bits); it also stands
    in for SkyReels-V2's ``SkyReelsV2AttnProcessor``: same signature and computation (its ``_get_qkv_projections``
    tests ``cross_attention_dim_head``, which is Wan's ``is_cross_attention``).
    """

    stock_processors = (WanAttnProcessor, SkyReelsV2AttnProcessor)

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        # attn2 attends to the text (and, in I2V, the image): both its calls are cross-attention.
        is_cross = encoder_hidden_states is not None
        rotary = rotary_emb if backend_rotates(rotary_emb, is_cross) else None
        return self._routed(
            attn,
            is_cross,
            WanAttnProcessor.__call__,
            hidden_states,
            encoder_hidden_states,
            attention_mask,
            None if rotary is not None else rotary_emb,
            rotary=rotary,
        )


def backend_rotates(rotary_emb: tuple[torch.Tensor, torch.Tensor] | None, is_cross: bool) -> bool:
    """Whether the backend applies the rotary embedding to the self-attention's query and key
    (``openvc_kernels.rotary.rotate_qk``: one launch on Hopper, diffusers' bits) instead of diffusers' code (ten
    PyTorch kernels per tensor): for self-attention in eager inference (``eager_inference``; compiled, inductor fuses
    diffusers' code with the QK norms)."""
    return rotary_emb is not None and not is_cross and eager_inference()
