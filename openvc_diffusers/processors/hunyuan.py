"""Open-VC for HunyuanVideo and HunyuanVideo-1.5: mirrors of ``HunyuanVideoAttnProcessor2_0`` and
``HunyuanVideo15AttnProcessor2_0``.

Both attend jointly over ``[video tokens, text tokens]`` (kind "self": it is the video tokens' attention) with
a mask that marks text padding. The models put the valid text first, so the valid keys are a prefix of the joint
sequence; when that holds in every batch row, Open-VC runs on the sequence trimmed to that prefix, with no mask.
The text-token refiner's attention (plain ``Attention`` with ``AttnProcessor2_0``) stays with diffusers.
The video tokens' rotary embedding takes one launch in eager inference (``rotate_video_tokens``), diffusers' bits.
"""

import weakref

import torch
import torch.nn.functional as F
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoAttnProcessor2_0
from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0

from openvc_kernels.rotary import rotate_qk

from .base import OpenVCProcessorBase, context_qkv, eager_inference, video_qkv

EXACT_IN_FP32 = (torch.float16, torch.bfloat16, torch.float32)
"""Input dtypes whose values FP32 holds exactly, so that diffusers' ``x.float()`` changes none of them."""
_paired_tables: tuple = ()
"""The last (cos, sin) that ``_pairs_are_equal`` checked: weak references, their versions, the answer. Every block of
a forward gets the same tables, so the check (which waits for the device) runs once per forward."""


def rotate_video_tokens(
    query: torch.Tensor, key: torch.Tensor, image_rotary_emb: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' ``apply_rotary_emb(x, image_rotary_emb, sequence_dim=1)`` of ``(B, S, H, D)`` query and key, bit
    for bit. In eager inference one launch for both (``rotate_qk``) where the tables have the form HunyuanVideo's RoPE
    gives them (``launch_rotates``); else diffusers' code, about ten PyTorch kernels per tensor."""
    cos, sin = image_rotary_emb
    if launch_rotates(query, cos, sin):
        return rotate_qk(query, key, cos[None, :, None], sin[None, :, None])
    return tuple(apply_rotary_emb(x, image_rotary_emb, sequence_dim=1) for x in (query, key))


def launch_rotates(query: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether ``rotate_qk`` gives ``apply_rotary_emb``'s bits here, in eager inference (``eager_inference``):
    q in a dtype FP32 holds exactly (``apply_rotary_emb`` computes in FP32: it rounds float64), FP32 ``(S, D)``
    tables on q's device with equal entries in each channel pair (``get_1d_rotary_pos_embed``'s
    ``repeat_interleave_real``). ``apply_rotary_emb`` computes pair i as ``x1 cos[2i] + (-x2) sin[2i]`` and
    ``x2 cos[2i+1] + x1 sin[2i+1]``, ``rotate_qk`` as ``x1 cos[2i] - x2 sin[2i+1]`` and ``x1 sin[2i+1] + x2 cos[2i]``,
    each product and sum rounded to FP32: the same numbers where the pair's entries are equal (negation is exact and
    addition commutes)."""
    table = (query.shape[1], query.shape[-1])
    return (
        eager_inference()
        and query.dtype in EXACT_IN_FP32
        and all(t.shape == table and t.dtype == torch.float32 and t.device == query.device for t in (cos, sin))
        and _pairs_are_equal(cos, sin)
    )


def _pairs_are_equal(cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether both tables hold equal entries in channels 2 i and 2 i + 1, remembered for the last pair checked.
    While a CUDA graph is captured an unchecked pair counts as unequal (the check would wait for the device)."""
    global _paired_tables
    versions = cos._version, sin._version
    if _paired_tables:
        cos_checked, sin_checked, versions_checked, equal = _paired_tables
        if cos_checked() is cos and sin_checked() is sin and versions_checked == versions:
            return equal
    if cos.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    equal = all(torch.equal(t[:, 0::2], t[:, 1::2]) for t in (cos, sin))
    _paired_tables = (weakref.ref(cos), weakref.ref(sin), versions, equal)
    return equal


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

    stock_processors = (HunyuanVideoAttnProcessor2_0,)

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
                video = slice(None, -encoder_hidden_states.shape[1])
                text = slice(-encoder_hidden_states.shape[1], None)
                video_query, video_key = rotate_video_tokens(query[:, video], key[:, video], image_rotary_emb)
                query = torch.cat([video_query, query[:, text]], dim=1)
                key = torch.cat([video_key, key[:, text]], dim=1)
            else:
                query, key = rotate_video_tokens(query, key, image_rotary_emb)

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

    stock_processors = (HunyuanVideo15AttnProcessor2_0,)

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
            query, key = rotate_video_tokens(query, key, image_rotary_emb)

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
