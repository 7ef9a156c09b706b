"""Open-VC for CogVideoX: a mirror of ``CogVideoXAttnProcessor2_0`` (joint ``[text, video]`` attention, rotary
embeddings on the video tokens).

CogVideoX's head dim is 64 and Open-VC's is 128, so every call takes the fallback chain; the policy logs why,
once. The processor is here so ``apply`` covers the family and ``calls`` shows where its attention went.
"""

import torch
from diffusers.models.attention_processor import CogVideoXAttnProcessor2_0
from diffusers.models.embeddings import apply_rotary_emb

from .base import OpenVCProcessorBase


class CogVideoXOpenVCProcessor(OpenVCProcessorBase):
    """``CogVideoXAttnProcessor2_0`` with attention through the policy (kind "self": the video tokens')."""

    stock_processors = (CogVideoXAttnProcessor2_0,)

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: torch.Tensor | None = None,
    ) -> torch.Tensor:
        text_seq_length = encoder_hidden_states.size(1)

        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)

        batch_size, sequence_length, _ = hidden_states.shape

        if attention_mask is not None:
            attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length, batch_size)
            attention_mask = attention_mask.view(batch_size, attn.heads, -1, attention_mask.shape[-1])

        query = attn.to_q(hidden_states)
        key = attn.to_k(hidden_states)
        value = attn.to_v(hidden_states)

        inner_dim = key.shape[-1]
        head_dim = inner_dim // attn.heads

        query = query.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        key = key.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        value = value.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)

        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)

        # Apply RoPE if needed
        if image_rotary_emb is not None:
            query[:, :, text_seq_length:] = apply_rotary_emb(query[:, :, text_seq_length:], image_rotary_emb)
            if not attn.is_cross_attention:
                key[:, :, text_seq_length:] = apply_rotary_emb(key[:, :, text_seq_length:], image_rotary_emb)

        # Stock calls F.scaled_dot_product_attention on (B, H, S, D); the SDPA backend gets the same strides back.
        query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        hidden_states = self._attend(attn, query, key, value, is_cross=False, attn_mask=attention_mask)

        # linear proj
        hidden_states = attn.to_out[0](hidden_states)
        # dropout
        hidden_states = attn.to_out[1](hidden_states)

        encoder_hidden_states, hidden_states = hidden_states.split(
            [text_seq_length, hidden_states.size(1) - text_seq_length], dim=1
        )
        return hidden_states, encoder_hidden_states
