"""Open-VC for Mochi: a mirror of ``MochiAttnProcessor2_0``.

Mochi attends jointly over ``[video tokens, valid prompt tokens]`` one batch row at a time, each row gathered
without its padding, so every call is unmasked (kind "self": it is the video tokens' attention).
``MochiAttention`` is a plain module with a ``processor`` attribute and no ``set_processor``;
``openvc_diffusers.apply`` sets the attribute.
"""

import torch
import torch.nn.functional as F
from diffusers.models.attention_processor import MochiAttnProcessor2_0

from .base import OpenVCProcessorBase, context_qkv, video_qkv


def apply_rotary_emb(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """Mochi's interleaved rotary embedding on (B, S, H, D), as diffusers' MochiAttnProcessor2_0 applies it."""
    x_even = x[..., 0::2].float()
    x_odd = x[..., 1::2].float()

    cos = (x_even * freqs_cos - x_odd * freqs_sin).to(x.dtype)
    sin = (x_even * freqs_sin + x_odd * freqs_cos).to(x.dtype)

    return torch.stack([cos, sin], dim=-1).flatten(-2)


class MochiOpenVCProcessor(OpenVCProcessorBase):
    """``MochiAttnProcessor2_0`` with attention through Open-VC."""

    stock_processors = (MochiAttnProcessor2_0,)

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        attention_mask: torch.Tensor,
        image_rotary_emb: torch.Tensor | None = None,
    ) -> torch.Tensor:
        query, key, value = video_qkv(attn, hidden_states)

        encoder_query, encoder_key, encoder_value = context_qkv(attn, encoder_hidden_states)

        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, *image_rotary_emb)
            key = apply_rotary_emb(key, *image_rotary_emb)

        query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        encoder_query, encoder_key, encoder_value = (
            encoder_query.transpose(1, 2),
            encoder_key.transpose(1, 2),
            encoder_value.transpose(1, 2),
        )

        sequence_length = query.size(2)
        encoder_sequence_length = encoder_query.size(2)
        total_length = sequence_length + encoder_sequence_length

        batch_size = query.size(0)
        attn_outputs = []
        for idx in range(batch_size):
            mask = attention_mask[idx][None, :]
            valid_prompt_token_indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()

            valid_encoder_query = encoder_query[idx : idx + 1, :, valid_prompt_token_indices, :]
            valid_encoder_key = encoder_key[idx : idx + 1, :, valid_prompt_token_indices, :]
            valid_encoder_value = encoder_value[idx : idx + 1, :, valid_prompt_token_indices, :]

            valid_query = torch.cat([query[idx : idx + 1], valid_encoder_query], dim=2)
            valid_key = torch.cat([key[idx : idx + 1], valid_encoder_key], dim=2)
            valid_value = torch.cat([value[idx : idx + 1], valid_encoder_value], dim=2)

            # (B, S, H, D) views for _attend, which hands SDPA these very (B, H, S, D) tensors back.
            attn_output = self._attend(
                attn, *(x.transpose(1, 2) for x in (valid_query, valid_key, valid_value)), is_cross=False
            )
            valid_sequence_length = attn_output.size(1)
            attn_output = F.pad(attn_output, (0, 0, 0, total_length - valid_sequence_length))
            attn_outputs.append(attn_output)

        hidden_states = torch.cat(attn_outputs, dim=0)

        hidden_states, encoder_hidden_states = hidden_states.split_with_sizes(
            (sequence_length, encoder_sequence_length), dim=1
        )

        # linear proj
        hidden_states = attn.to_out[0](hidden_states)
        # dropout
        hidden_states = attn.to_out[1](hidden_states)

        if hasattr(attn, "to_add_out"):
            encoder_hidden_states = attn.to_add_out(encoder_hidden_states)

        return hidden_states, encoder_hidden_states
