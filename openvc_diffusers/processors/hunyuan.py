"""Open-VC for HunyuanVideo and HunyuanVideo-1.5: mirrors of ``HunyuanVideoAttnProcessor2_0`` and
``HunyuanVideo15AttnProcessor2_0``.

Both attend jointly over ``[video tokens, text tokens]`` (kind "self": it is the video tokens' attention) with
a mask that marks text padding. The models put the valid text first, so the valid keys are a prefix of the joint
sequence; when that holds in every batch row, Open-VC runs on the sequence trimmed to that prefix, with no mask.
The text-token refiner's attention (plain ``Attention`` with ``AttnProcessor2_0``) stays with diffusers.
"""

import torch
import torch.nn.functional as F
from diffusers.models.embeddings import apply_rotary_emb

from .base import OpenVCProcessorBase, context_qkv, video_qkv


def valid_prefix_length(mask: torch.Tensor) -> int | None:
    """``n`` if every row of the boolean ``(B, N)`` mask is True on exactly its first ``n`` entries, else None."""
    n = int(mask[0].sum())
    prefix = torch.arange(mask.shape[1], device=mask.device) < n
    return n if bool((mask == prefix).all()) else None


def output_projection(attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None):
    """Split the joint output back into video and text and project each, as both HunyuanVideo processors do."""
    if encoder_hidden_states is not None:
        hidden_states, encoder_hidden_states = (
            hidden_states[:, : -encoder_hidden_states.shape[1]],
            hidden_states[:, -encoder_hidden_states.shape[1] :],
        )

        if getattr(attn, "to_out", None) is not None:
            hidden_states = attn.to_out[0](hidden_states)
            hidden_states = attn.to_out[1](hidden_states)

        if getattr(attn, "to_add_out", None) is not None:
            encoder_hidden_states = attn.to_add_out(encoder_hidden_states)

    return hidden_states, encoder_hidden_states


class HunyuanVideoOpenVCProcessor(OpenVCProcessorBase):
    """``HunyuanVideoAttnProcessor2_0`` (dual- and single-stream blocks) with attention through Open-VC."""

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if attn.add_q_proj is None and encoder_hidden_states is not None:
            hidden_states = torch.cat([hidden_states, encoder_hidden_states], dim=1)

        # 1-2. QKV projections and QK normalization
        query, key, value = video_qkv(attn, hidden_states)

        # 3. Rotational positional embeddings applied to latent stream
        if image_rotary_emb is not None:
            if attn.add_q_proj is None and encoder_hidden_states is not None:
                query = torch.cat(
                    [
                        apply_rotary_emb(query[:, : -encoder_hidden_states.shape[1]], image_rotary_emb, sequence_dim=1),
                        query[:, -encoder_hidden_states.shape[1] :],
                    ],
                    dim=1,
                )
                key = torch.cat(
                    [
                        apply_rotary_emb(key[:, : -encoder_hidden_states.shape[1]], image_rotary_emb, sequence_dim=1),
                        key[:, -encoder_hidden_states.shape[1] :],
                    ],
                    dim=1,
                )
            else:
                query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
                key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)

        # 4. Encoder condition QKV projection and normalization
        if attn.add_q_proj is not None and encoder_hidden_states is not None:
            encoder_query, encoder_key, encoder_value = context_qkv(attn, encoder_hidden_states)

            query = torch.cat([query, encoder_query], dim=1)
            key = torch.cat([key, encoder_key], dim=1)
            value = torch.cat([value, encoder_value], dim=1)

        # 5. Attention. The model's mask is (B, 1, 1, N): one key mask for every head and query.
        valid_len = None
        if attention_mask is not None and attention_mask.dtype == torch.bool and attention_mask.shape[1:-1] == (1, 1):
            valid_len = valid_prefix_length(attention_mask.flatten(1))
        hidden_states = self._attend(
            attn, query, key, value, is_cross=False, attn_mask=attention_mask, valid_len=valid_len
        )

        # 6. Output projection
        return output_projection(attn, hidden_states, encoder_hidden_states)


class HunyuanVideo15OpenVCProcessor(OpenVCProcessorBase):
    """``HunyuanVideo15AttnProcessor2_0`` with attention through Open-VC."""

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # 1-2. QKV projections and QK normalization
        query, key, value = video_qkv(attn, hidden_states)

        # 3. Rotational positional embeddings applied to latent stream
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)

        # 4. Encoder condition QKV projection and normalization
        if encoder_hidden_states is not None:
            encoder_query, encoder_key, encoder_value = context_qkv(attn, encoder_hidden_states)

            query = torch.cat([query, encoder_query], dim=1)
            key = torch.cat([key, encoder_key], dim=1)
            value = torch.cat([value, encoder_value], dim=1)

        batch_size, seq_len, heads, dim = query.shape
        attention_mask = F.pad(attention_mask, (seq_len - attention_mask.shape[1], 0), value=True)
        attention_mask = attention_mask.bool()
        # The (B, S) token mask, before it becomes the (B, 1, S, S) mask below, which hides padded queries too.
        valid_len = valid_prefix_length(attention_mask)
        self_attn_mask_1 = attention_mask.view(batch_size, 1, 1, seq_len).repeat(1, 1, seq_len, 1)
        self_attn_mask_2 = self_attn_mask_1.transpose(2, 3)
        attention_mask = (self_attn_mask_1 & self_attn_mask_2).bool()

        # 5. Attention
        hidden_states = self._attend(
            attn, query, key, value, is_cross=False, attn_mask=attention_mask, valid_len=valid_len, pad_queries=True
        )

        # 6. Output projection
        return output_projection(attn, hidden_states, encoder_hidden_states)
