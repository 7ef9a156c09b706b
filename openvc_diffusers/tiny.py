"""A tiny, randomly initialised Wan 2.1 text-to-video pipeline built entirely in code.

It has the real Wan structure (UMT5 text encoder, causal 3D VAE with 4x temporal / 8x spatial
compression, 3D-RoPE transformer with patch (1, 2, 2)) and the real attention head dim of 128, so the
attention processors see the same kinds of calls as on the full model, but it needs no download and
runs in seconds on a CPU. Its videos are noise: it is for exercising code paths, not for looking at.
"""

import string

import torch
from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel


# 5 frames -> 2 latent frames; 128x160 px -> 16x20 latents -> 8x10 patches: 2 * 8 * 10 = 160 video tokens.
# That is more than one 128-row attention tile with a ragged tail, and H != W catches mixed-up RoPE axes.
TINY_VIDEO = dict(height=128, width=160, num_frames=5)

_TEXT_DIM = 32
_Z_DIM = 4


def _tiny_tokenizer() -> PreTrainedTokenizerFast:
    # One token per printable ASCII character: any prompt encodes without a vocabulary file, and
    # different prompts give different ids. The special tokens sit at T5's ids (pad 0, eos 1, unk 2).
    vocab = {token: i for i, token in enumerate(["<pad>", "</s>", "<unk>", *string.printable])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    # T5 appends </s>; WanPipeline relies on it through add_special_tokens=True.
    tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", padding_side="right"
    )


def tiny_wan_pipeline(
    *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", seed: int = 0
) -> WanPipeline:
    """Build a tiny random-weight `WanPipeline`; the same `seed` gives the same weights on every device.

    `dtype` applies to the transformer and text encoder; the VAE stays in float32, as Wan's model card
    recommends for the real model.
    """
    tokenizer = _tiny_tokenizer()

    # Build on CPU under a forked RNG: weights do not depend on the device, and the caller's RNG is untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = UMT5EncoderModel(
            UMT5Config(
                vocab_size=len(tokenizer),
                d_model=_TEXT_DIM,
                d_kv=8,
                d_ff=64,
                num_layers=1,
                num_heads=4,
                dropout_rate=0.0,
            )
        )
        vae = _tiny_vae()
        transformer = _tiny_transformer()

    # Wan 2.1's own scheduler configuration (flow matching through UniPC, shift 3.0 for 480p).
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=3.0
    )

    return WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder.to(device, dtype).eval(),
        vae=vae.to(device).eval(),
        scheduler=scheduler,
        transformer=cast_like_from_pretrained(transformer, dtype).to(device).eval(),
    )


def _tiny_vae() -> AutoencoderKLWan:
    return AutoencoderKLWan(
        base_dim=8,
        z_dim=_Z_DIM,
        # Four levels and two temporal downsamples keep Wan's 8x spatial / 4x temporal compression.
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        # The default latent statistics have one entry per channel of the 16-channel Wan VAE.
        latents_mean=[0.0] * _Z_DIM,
        latents_std=[1.0] * _Z_DIM,
    )


def tiny_wan_vae(*, seed: int = 0) -> AutoencoderKLWan:
    """The tiny pipeline's VAE on its own, float32 on the CPU."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _tiny_vae().eval()


def _tiny_transformer(image_dim: int | None = None) -> WanTransformer3DModel:
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        # The FP8 attention path only takes head dim 128, like every supported video model.
        attention_head_dim=128,
        in_channels=_Z_DIM,
        out_channels=_Z_DIM,
        text_dim=_TEXT_DIM,
        freq_dim=32,
        ffn_dim=64,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        image_dim=image_dim,
        rope_max_seq_len=32,
    )
    # diffusers draws each block's modulation table (shift, scale, gate) as randn / sqrt(dim), which
    # gates attention by ~0.05 and damps attention errors ~40x on their way to the output. With unit
    # variance, 1% noise in self-attention moves the noise prediction by 0.6% rather than 0.025%.
    for block in transformer.blocks:
        torch.nn.init.normal_(block.scale_shift_table)
    return transformer


def tiny_wan_transformer(*, image_dim: int | None = None, seed: int = 0) -> WanTransformer3DModel:
    """The tiny pipeline's transformer on its own, float32 on the CPU; ``image_dim`` adds Wan I2V's image
    context projections."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _tiny_transformer(image_dim).eval()


def tiny_wan_inputs(*, image_dim: int | None = None, seed: int = 0) -> dict:
    """Random inputs for ``tiny_wan_transformer`` at ``TINY_VIDEO``'s size (2 x 8 x 10 = 160 video tokens)."""
    g = torch.Generator().manual_seed(seed)
    inputs = dict(
        hidden_states=torch.randn(1, _Z_DIM, 2, 16, 20, generator=g),
        timestep=torch.tensor([500]),
        encoder_hidden_states=torch.randn(1, 512, _TEXT_DIM, generator=g),
        return_dict=False,
    )
    if image_dim is not None:
        inputs["encoder_hidden_states_image"] = torch.randn(1, 257, image_dim, generator=g)
    return inputs


def cast_like_from_pretrained(model, dtype: torch.dtype):
    """What ``from_pretrained(torch_dtype=dtype)`` does: parameters take ``dtype`` except in the modules the model
    keeps in float32 (for Wan: RoPE, time embedding, norms, modulation tables); buffers such as the RoPE tables
    keep theirs. ``model.to(dtype)`` would cast everything, and diffusers warns about it."""
    keep = model._keep_in_fp32_modules or []
    for name, param in model.named_parameters():
        if not any(module in name.split(".") for module in keep):
            param.data = param.data.to(dtype)
    return model
