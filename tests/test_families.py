"""apply() on a tiny random model of every video DiT family: with SDPA only it is diffusers, bit for bit; with
Open-VC each call takes the path it should, and the output stays close to diffusers'."""

import importlib
import logging

import pytest
import torch
from openvc_diffusers.metrics import rel_l2
from diffusers import (
    CogVideoXTransformer3DModel,
    HunyuanVideo15Transformer3DModel,
    HunyuanVideoTransformer3DModel,
    LTXVideoTransformer3DModel,
    MochiTransformer3DModel,
    SkyReelsV2Transformer3DModel,
    WanTransformer3DModel,
)
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.attention_processor import AttnProcessor2_0

import openvc_diffusers
from openvc_diffusers import policy
from openvc_diffusers.apply import FAMILIES
from openvc_diffusers.processors import hunyuan
from openvc_diffusers.processors.hunyuan import valid_prefix_length
from openvc_kernels.rotary import rotate_qk

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    # Mochi's RoPE asks for float32 autocast, which the CPU does not have; it runs in float32 regardless.
    pytest.mark.filterwarnings("ignore:In CPU autocast:UserWarning"),
]

# The module, not the attention() function that the package exports under the same name.
attention_module = importlib.import_module("openvc_diffusers.attention")

SELF, CROSS, OPENVC, SDPA = "self", "cross", "openvc-reference", "sdpa"


def text_mask(*valid: int, length: int) -> torch.Tensor:
    """(B, length) prompt mask: row b has valid[b] tokens, then padding."""
    return (torch.arange(length) < torch.tensor(valid)[:, None]).long()


# Builders: a tiny random model (2 layers or fewer, head dim 128 except CogVideoX's 64, 100-200 video tokens)
# and its forward's inputs.


def wan(model_cls=WanTransformer3DModel):
    model = model_cls(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=128, in_channels=4, out_channels=4,
        text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=32,
    )  # fmt: skip
    inputs = dict(hidden_states=torch.randn(1, 4, 2, 16, 20), timestep=torch.tensor([500]),
                  encoder_hidden_states=torch.randn(1, 512, 32))  # fmt: skip
    return model, inputs


def skyreels():
    return wan(SkyReelsV2Transformer3DModel)


def ltx():
    model = LTXVideoTransformer3DModel(
        in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=128, cross_attention_dim=256,
        num_layers=2, caption_channels=32,
    )  # fmt: skip
    # LTX takes patchified latents: (B, frames * height * width, channels).
    inputs = dict(hidden_states=torch.randn(1, 3 * 8 * 8, 8), encoder_hidden_states=torch.randn(1, 16, 32),
                  timestep=torch.tensor([500]), encoder_attention_mask=text_mask(12, length=16),
                  num_frames=3, height=8, width=8)  # fmt: skip
    return model, inputs


def hunyuan_video(valid=(20, 20)):
    model = HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=128, num_layers=1,
        num_single_layers=1, num_refiner_layers=1, mlp_ratio=1.0, text_embed_dim=32, pooled_projection_dim=16,
    )  # fmt: skip
    batch = len(valid)
    inputs = dict(hidden_states=torch.randn(batch, 4, 2, 16, 16), timestep=torch.tensor([500] * batch),
                  encoder_hidden_states=torch.randn(batch, 24, 32), encoder_attention_mask=text_mask(*valid, length=24),
                  pooled_projections=torch.randn(batch, 16), guidance=torch.tensor([5000.0] * batch))  # fmt: skip
    return model, inputs


def hunyuan_video15():
    model = HunyuanVideo15Transformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=128, num_layers=2,
        num_refiner_layers=1, mlp_ratio=1.0, text_embed_dim=32, text_embed_2_dim=16, image_embed_dim=16,
    )  # fmt: skip
    # All-zero image embeddings: text-to-video, the image tokens are padding too.
    inputs = dict(hidden_states=torch.randn(1, 4, 2, 8, 8), timestep=torch.tensor([500.0]),
                  encoder_hidden_states=torch.randn(1, 24, 32), encoder_attention_mask=text_mask(20, length=24),
                  encoder_hidden_states_2=torch.randn(1, 8, 16), encoder_attention_mask_2=text_mask(6, length=8),
                  image_embeds=torch.zeros(1, 4, 16))  # fmt: skip
    return model, inputs


def cogvideox():
    model = CogVideoXTransformer3DModel(
        num_attention_heads=2, attention_head_dim=64, in_channels=4, out_channels=4, time_embed_dim=32,
        text_embed_dim=32, num_layers=2, sample_width=8, sample_height=8, sample_frames=9, max_text_seq_length=16,
        use_rotary_positional_embeddings=True,
    )  # fmt: skip
    angles = torch.randn(3 * 4 * 4, 64)  # the pipeline computes RoPE; any (video tokens, head dim) cos/sin do here
    inputs = dict(hidden_states=torch.randn(1, 3, 4, 8, 8), encoder_hidden_states=torch.randn(1, 16, 32),
                  timestep=torch.tensor([500]), image_rotary_emb=(angles.cos(), angles.sin()))  # fmt: skip
    return model, inputs


def mochi():
    model = MochiTransformer3DModel(
        patch_size=2, num_attention_heads=2, attention_head_dim=128, num_layers=2, pooled_projection_dim=32,
        in_channels=4, text_embed_dim=16, time_embed_dim=32, max_sequence_length=16,
    )  # fmt: skip
    inputs = dict(hidden_states=torch.randn(2, 4, 2, 16, 16), encoder_hidden_states=torch.randn(2, 16, 16),
                  timestep=torch.tensor([500, 500]), encoder_attention_mask=text_mask(10, 13, length=16))  # fmt: skip
    return model, inputs


BUILDERS = {f.__name__: f for f in (wan, skyreels, ltx, hunyuan_video, hunyuan_video15, cogvideox, mochi)}

# The calls of one forward with {"min_tokens": 0}. Joint video+text attention is "self"; Mochi attends one batch
# row per call; CogVideoX's head dim 64 always takes the fallback.
EXPECTED_CALLS = {
    "wan": {(SELF, OPENVC): 2, (CROSS, SDPA): 2},
    "skyreels": {(SELF, OPENVC): 2, (CROSS, SDPA): 2},
    "ltx": {(SELF, OPENVC): 2, (CROSS, SDPA): 2},
    "hunyuan_video": {(SELF, OPENVC): 2},
    "hunyuan_video15": {(SELF, OPENVC): 2},
    "cogvideox": {(SELF, SDPA): 2},
    "mochi": {(SELF, OPENVC): 4},
}


def build(name: str, dtype=torch.float32, **kwargs):
    torch.manual_seed(0)
    model, inputs = BUILDERS[name](**kwargs)
    floats = {k: v.to(dtype) for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}
    inputs.update(floats)
    return model.to(dtype).eval(), inputs


def forward(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0]


@pytest.mark.parametrize("name", BUILDERS)
def test_sdpa_backend_is_identical_to_diffusers(name):
    model, inputs = build(name)
    stock = forward(model, inputs)
    openvc_diffusers.apply(model, {"backends": ["sdpa"]})
    assert torch.equal(forward(model, inputs), stock)


@pytest.mark.parametrize("name", BUILDERS)
def test_each_call_takes_its_path_and_output_stays_close(name):
    model, inputs = build(name)
    stock = forward(model, inputs)
    processor = openvc_diffusers.apply(model, {"min_tokens": 0})
    ours = forward(model, inputs)
    assert processor.calls == EXPECTED_CALLS[name]
    assert rel_l2(ours, stock) < 0.05


def test_cogvideox_head_dim_fallback_is_logged_once(caplog, monkeypatch):
    monkeypatch.setattr(attention_module, "_said", set())  # forget what earlier tests logged
    model, inputs = build("cogvideox")
    openvc_diffusers.apply(model, {"min_tokens": 0})
    with caplog.at_level(logging.WARNING, logger="openvc_diffusers"):
        forward(model, inputs)
        forward(model, inputs)
    messages = [r.getMessage() for r in caplog.records if "head_dim" in r.getMessage()]
    assert messages == ["Open-VC fallback to sdpa: openvc: head_dim 64; Open-VC takes head_dim 128"]


def test_hunyuan_video_ragged_text_masks_keep_the_mask(caplog):
    # Rows with different prompt lengths: no one trim fits every row, so the masked call goes to SDPA.
    model, inputs = build("hunyuan_video", valid=(20, 14))
    stock = forward(model, inputs)
    processor = openvc_diffusers.apply(model, {"min_tokens": 0})
    with caplog.at_level(logging.WARNING, logger="openvc_diffusers"):
        ours = forward(model, inputs)
    assert processor.calls == {(SELF, SDPA): 2}
    assert torch.equal(ours, stock)
    assert any("openvc: an attention mask was given" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("name", ["hunyuan_video", "hunyuan_video15"])
def test_trimming_to_the_valid_prefix_is_exact(name, monkeypatch):
    # Exact attention in place of the reference, in float64: the trimmed, unmasked call attends over what the
    # stock masked call does, so the outputs agree to float64 rounding.
    monkeypatch.setattr(attention_module, "run_reference", lambda q, k, v, *_: dispatch_attention_fn(q, k, v))
    monkeypatch.setattr(policy, "INPUT_DTYPES", (*policy.INPUT_DTYPES, torch.float64))  # the stand-in takes it
    model, inputs = build(name, dtype=torch.float64)
    stock = forward(model, inputs)
    processor = openvc_diffusers.apply(model, {"min_tokens": 0})
    ours = forward(model, inputs)
    assert processor.calls == {(SELF, OPENVC): 2}
    torch.testing.assert_close(ours, stock, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["hunyuan_video", "hunyuan_video15"])
def test_hunyuan_rotary_in_one_launch_is_diffusers_bitwise(name, dtype, monkeypatch):
    """In inference the HunyuanVideo processors rotate the video tokens' q and k with ``rotate_qk`` (its reference
    on the CPU, one launch on Hopper): the SDPA-routed forward is diffusers' bit for bit, with every block on it."""
    model, inputs = build(name, dtype=dtype)
    stock = forward(model, inputs)
    openvc_diffusers.apply(model, {"backends": ["sdpa"]})
    rotated = []
    monkeypatch.setattr(hunyuan, "rotate_qk", lambda *args: rotated.append(args[0].shape) or rotate_qk(*args))
    assert torch.equal(forward(model, inputs), stock)
    assert len(rotated) == 2, rotated  # two blocks in either tiny model


def test_hunyuan_launch_takes_only_tables_with_equal_pairs():
    """``launch_rotates``: autograd off, q in a dtype FP32 holds, FP32 (S, D) tables whose channel pairs hold equal
    entries; an in-place change of a table is checked again."""
    q = torch.randn(1, 6, 2, 128)
    angles = torch.rand(6, 64) * 10
    cos, sin = (f(angles).repeat_interleave(2, dim=-1) for f in (torch.cos, torch.sin))
    assert not hunyuan.launch_rotates(q, cos, sin)  # autograd on
    with torch.no_grad():
        assert hunyuan.launch_rotates(q, cos, sin) and hunyuan.launch_rotates(q.bfloat16(), cos, sin)
        assert not hunyuan.launch_rotates(q.double(), cos, sin)
        assert not hunyuan.launch_rotates(q, cos.double(), sin)
        assert not hunyuan.launch_rotates(q[:, :5], cos, sin)
        sin[3, 7] += 1.0
        assert not hunyuan.launch_rotates(q, cos, sin)
        unpaired = torch.cos(torch.rand(6, 128))
        assert not hunyuan.launch_rotates(q, unpaired, sin)


def test_valid_prefix_length():
    assert valid_prefix_length(torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]]).bool()) == 3
    assert valid_prefix_length(torch.ones(2, 4, dtype=torch.bool)) == 4
    assert valid_prefix_length(torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]).bool()) is None  # rows differ
    assert valid_prefix_length(torch.tensor([[1, 0, 1, 0]]).bool()) is None  # not a prefix


def test_hunyuan_text_refiner_keeps_diffusers_processor():
    model, _ = build("hunyuan_video")
    openvc_diffusers.apply(model)
    refiner = model.context_embedder.token_refiner.refiner_blocks[0].attn
    assert type(refiner.processor) is AttnProcessor2_0


def test_apply_refuses_attention_it_does_not_cover():
    model, _ = build("wan")
    model.blocks[1].attn2.set_processor(AttnProcessor2_0())
    with pytest.raises(ValueError, match="Wan.*does not cover: AttnProcessor2_0"):
        openvc_diffusers.apply(model)
    with pytest.raises(ValueError, match="not supported") as error:
        openvc_diffusers.apply(torch.nn.Linear(2, 2))
    assert all(family.name in str(error.value) for family in FAMILIES)


def test_a_processor_refuses_attention_of_another_family():
    """Installed by hand on a module whose class names another stock processor, a family's processor says which
    it mirrors at the first call, where its stock code failed on a missing attribute (LTX under Wan's: add_k_proj)."""
    from openvc_diffusers.processors import LTXVideoOpenVCProcessor, OpenVCProcessor

    for name, processor, module, stock in (
        ("ltx", OpenVCProcessor(), "LTXAttention", "LTXVideoAttnProcessor"),
        ("wan", LTXVideoOpenVCProcessor(), "WanAttention", "WanAttnProcessor"),
    ):
        model, inputs = build(name)
        model.set_attn_processor(processor)
        mirrors = ", ".join(c.__name__ for c in processor.stock_processors)
        message = rf"{type(processor).__name__} mirrors {mirrors}, but {module} runs diffusers\.models\..*\.{stock}: "
        with pytest.raises(TypeError, match=message):
            forward(model, inputs)
    for name in ("wan", "skyreels", "ltx"):  # each family's own processor is taken where apply puts it
        model, inputs = build(name)
        family = next(f for f in FAMILIES if type(next(iter(model.attn_processors.values()))) in f.stock)
        model.set_attn_processor(family.processor({"min_tokens": 0}))
        forward(model, inputs)


def test_step_tracking_finds_a_positional_timestep():
    # LTX takes timestep third; bf16_steps must still see the steps.
    model, inputs = build("ltx")
    processor = openvc_diffusers.apply(model, {"min_tokens": 0, "bf16_steps": [0]})
    args = [inputs.pop(k) for k in ("hidden_states", "encoder_hidden_states", "timestep")]
    for timestep in (900, 800):
        args[2] = torch.tensor([timestep])
        with torch.no_grad():
            model(*args, **inputs)
    assert processor.step == 1
    assert processor.calls == {(SELF, SDPA): 2, (SELF, OPENVC): 2, (CROSS, SDPA): 4}
