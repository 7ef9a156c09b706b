"""Open-VC for Wan-style attention: Wan 2.1/2.2 (T2V, I2V, TI2V), SkyReels-V2, and any model whose
processor has ``WanAttnProcessor``'s signature (rotary embeddings, QK norms, I2V image context)."""

import torch
from diffusers.models.transformers.transformer_wan import _get_added_kv_projections, _get_qkv_projections

from .base import OpenVCProcessorBase

TEXT_CONTEXT_LEN = 512
"""Wan's text encoder context length; I2V prepends the image tokens before it (as diffusers does)."""


def apply_rotary_emb(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """Wan's interleaved rotary embedding on (B, S, H, D), as diffusers' WanAttnProcessor applies it."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


class OpenVCProcessor(OpenVCProcessorBase):
    """Attention processor that sends Wan self-attention to Open-VC FP8 attention, by policy.

    ``pipe.transformer.set_attn_processor(OpenVCProcessor(config))``: ``config`` is anything
    ``openvc_diffusers.load_config`` takes (None for the defaults, a dict, a YAML path, a config).
    It also stands in for SkyReels-V2's ``SkyReelsV2AttnProcessor``: same signature and computation (its
    ``_get_qkv_projections`` tests ``cross_attention_dim_head``, which is Wan's ``is_cross_attention``).
    """

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        is_cross = encoder_hidden_states is not None
        encoder_hidden_states_img = None
        if attn.add_k_proj is not None:
            image_context_length = encoder_hidden_states.shape[1] - TEXT_CONTEXT_LEN
            encoder_hidden_states_img = encoder_hidden_states[:, :image_context_length]
            encoder_hidden_states = encoder_hidden_states[:, image_context_length:]

        query, key, value = _get_qkv_projections(attn, hidden_states, encoder_hidden_states)
        query = attn.norm_q(query).unflatten(2, (attn.heads, -1))
        key = attn.norm_k(key).unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))
        if rotary_emb is not None:
            query = apply_rotary_emb(query, *rotary_emb)
            key = apply_rotary_emb(key, *rotary_emb)

        hidden_states_img = None
        if encoder_hidden_states_img is not None:
            key_img, value_img = _get_added_kv_projections(attn, encoder_hidden_states_img)
            key_img = attn.norm_added_k(key_img).unflatten(2, (attn.heads, -1))
            value_img = value_img.unflatten(2, (attn.heads, -1))
            hidden_states_img = self._attend(attn, query, key_img, value_img, is_cross=True)

        hidden_states = self._attend(attn, query, key, value, is_cross=is_cross, attn_mask=attention_mask)
        if hidden_states_img is not None:
            hidden_states = hidden_states + hidden_states_img

        hidden_states = attn.to_out[0](hidden_states)
        return attn.to_out[1](hidden_states)
