"""Open-VC for LTX-Video: diffusers' ``LTXVideoAttnProcessor`` (self-attention ``attn1`` with rotary embeddings,
text cross-attention ``attn2`` with the prompt's padding mask) with its attention routed through the "openvc"
backend."""

import torch
from diffusers.models.transformers.transformer_ltx import LTXVideoAttnProcessor

from .base import OpenVCProcessorBase


class LTXVideoOpenVCProcessor(OpenVCProcessorBase, LTXVideoAttnProcessor):
    """``LTXVideoAttnProcessor`` with attention through Open-VC."""

    stock_processors = (LTXVideoAttnProcessor,)

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: torch.Tensor | None = None,
    ) -> torch.Tensor:
        is_cross = encoder_hidden_states is not None
        return self._routed(
            attn,
            is_cross,
            LTXVideoAttnProcessor.__call__,
            hidden_states,
            encoder_hidden_states,
            attention_mask,
            image_rotary_emb,
        )
