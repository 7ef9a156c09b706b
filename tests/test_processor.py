"""Processor routing on tiny random Wan models: which calls take which backend, and sdpa == diffusers."""

import importlib
import logging
import re

import pytest
import torch
from helpers import exact_attention
from openvc_diffusers.metrics import rel_l2

import openvc_diffusers
import openvc_kernels
from openvc_diffusers import OpenVCProcessor
from openvc_diffusers.steps import StepTracker
from openvc_diffusers.tiny import TINY_VIDEO, tiny_wan_inputs, tiny_wan_pipeline, tiny_wan_transformer

SELF, CROSS = "self", "cross"
# The module, not the attention() function that the package exports under the same name.
attention_module = importlib.import_module("openvc_diffusers.attention")


@pytest.mark.parametrize("image_dim", [None, 48], ids=["t2v", "i2v"])
def test_sdpa_backend_is_identical_to_diffusers(image_dim):
    model, inputs = tiny_wan_transformer(image_dim=image_dim), tiny_wan_inputs(image_dim=image_dim)
    with torch.no_grad():
        stock = model(**inputs)[0]
        model.set_attn_processor(OpenVCProcessor({"backends": ["sdpa"]}))
        ours = model(**inputs)[0]
    assert torch.equal(ours, stock)


def test_tiny_pipeline_routes_self_attention_to_openvc():
    pipe = tiny_wan_pipeline()
    processor = OpenVCProcessor({"min_tokens": 0})
    pipe.transformer.set_attn_processor(processor)
    video = pipe(prompt="a cat", num_inference_steps=2, guidance_scale=5.0, output_type="np", **TINY_VIDEO).frames
    # 2 steps x 2 transformer calls (classifier-free guidance) x 2 layers.
    assert processor.calls == {(SELF, "openvc-reference"): 8, (CROSS, "sdpa"): 8}
    assert torch.isfinite(torch.as_tensor(video)).all()


def test_openvc_output_is_close_to_bf16():
    model, inputs = tiny_wan_transformer(), tiny_wan_inputs()
    with torch.no_grad():
        stock = model(**inputs)[0]
        model.set_attn_processor(OpenVCProcessor({"min_tokens": 0}))
        ours = model(**inputs)[0]
    assert 0 < rel_l2(ours, stock) < 0.05


def test_short_sequences_fall_back_with_a_logged_reason(caplog):
    model, inputs = tiny_wan_transformer(), tiny_wan_inputs()
    processor = OpenVCProcessor()  # min_tokens 1024 > 160 video tokens
    model.set_attn_processor(processor)
    with caplog.at_level(logging.WARNING, logger="openvc_diffusers"), torch.no_grad():
        model(**inputs)
        model(**inputs)
    assert processor.calls == {(SELF, "sdpa"): 4, (CROSS, "sdpa"): 4}
    messages = [r.getMessage() for r in caplog.records if "min_tokens" in r.getMessage()]
    assert messages == ["Open-VC fallback to sdpa: openvc: 160 query tokens < min_tokens 1024"]


def test_bf16_layers_take_the_fallback():
    model, inputs = tiny_wan_transformer(), tiny_wan_inputs()
    processor = OpenVCProcessor({"min_tokens": 0, "bf16_layers": [1]})
    model.set_attn_processor(processor)
    with torch.no_grad():
        model(**inputs)
    assert processor.calls == {(SELF, "openvc-reference"): 1, (SELF, "sdpa"): 1, (CROSS, "sdpa"): 2}


def test_apply_tracks_steps_for_bf16_steps():
    pipe = tiny_wan_pipeline()
    processor = openvc_diffusers.apply(pipe, {"min_tokens": 0, "bf16_steps": [0]})
    pipe(prompt="a cat", num_inference_steps=3, guidance_scale=5.0, output_type="latent", **TINY_VIDEO)
    # Step 0 (2 calls x 2 layers) in BF16, steps 1 and 2 on Open-VC.
    assert processor.calls[SELF, "sdpa"] == 4
    assert processor.calls[SELF, "openvc-reference"] == 8
    assert processor.step == 2


def test_unwatched_steps_are_read_when_asked_not_at_every_forward(monkeypatch):
    # Reading a timestep on the GPU synchronizes: without bf16_steps nothing needs the step during a forward.
    tracker = StepTracker()
    reads = []
    read = tracker._read_pending
    monkeypatch.setattr(tracker, "_read_pending", lambda: reads.append(len(tracker._pending)) or read())
    last = torch.tensor([700.0])
    for timestep in [torch.tensor([900.0]), torch.tensor([900.0]), torch.tensor([800.0]), last]:
        tracker(None, (), {"timestep": timestep})
    last.fill_(100.0)  # the pipeline's tensor changes after the forward: the tracker kept the value it had
    assert reads == [] and tracker.watched_step is None
    assert tracker.step == 2 and reads == [4]
    for timestep in [1000.0, 900.0]:  # a new generation
        tracker(None, (), {"timestep": torch.tensor(timestep)})
    assert tracker.step == 1 and reads == [4, 2]
    assert tracker.step == 1 and reads == [4, 2, 0]  # nothing kept: nothing read
    monkeypatch.setattr(StepTracker, "PENDING_LIMIT", 3)
    for timestep in [1000.0, 900.0, 800.0, 700.0]:
        tracker(None, (), {"timestep": torch.tensor([timestep])})
    assert reads == [4, 2, 0, 3]  # what it keeps is bounded
    assert tracker.step == 3


def test_watched_steps_are_read_at_every_forward():
    tracker = StepTracker(watched={1})
    seen = []
    for timestep in [900.0, 900.0, 800.0, 700.0]:
        tracker(None, (), {"timestep": torch.tensor([timestep])})
        seen.append((tracker._step, tracker.watched_step))
    assert seen == [(0, None), (0, None), (1, 1), (2, None)]


def test_processors_applied_in_turn_each_count_the_steps():
    # examples/bench_pipeline.py installs one processor per backend on one model and switches between them: each
    # apply adds its own tracker, which reads nothing unless its bf16_steps watch the steps.
    model, inputs = tiny_wan_transformer(), tiny_wan_inputs()
    plain = openvc_diffusers.apply(model, {"min_tokens": 0})
    watching = openvc_diffusers.apply(model, {"min_tokens": 0, "bf16_steps": [1]})
    with torch.no_grad():
        for timestep, processor in [(900, watching), (800, plain), (700, watching)]:
            model.set_attn_processor(processor)
            model(**{**inputs, "timestep": torch.tensor([timestep])})
    assert plain.step == watching.step == 2
    assert plain.calls == {(SELF, "openvc-reference"): 2, (CROSS, "sdpa"): 2}
    assert watching.calls == {(SELF, "openvc-reference"): 4, (CROSS, "sdpa"): 4}
    assert plain.step_tracker._pending == [] and watching.step_tracker.watched_step is None


def test_apply_rejects_unsupported_models():
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel(
        block_out_channels=(32, 64),
        layers_per_block=1,
        sample_size=8,
        in_channels=4,
        out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32,
    )
    with pytest.raises(ValueError, match="not supported.*supported: Wan"):
        openvc_diffusers.apply(unet)


def test_attention_function_on_cpu_uses_the_reference():
    q, k, v = (torch.randn(1, 300, 2, 128, dtype=torch.bfloat16) for _ in range(3))
    out = openvc_diffusers.attention(q, k, v, {"min_tokens": 0})  # the default repair and K smoothing
    expected = openvc_kernels.reference_attention(q, k, v, repair_ratio=0.005, smooth_k=True, window=4)
    assert torch.equal(out, expected)
    assert rel_l2(out, exact_attention(q, k, v)) < 0.065
    plain = openvc_diffusers.attention(q, k, v, {"min_tokens": 0, "repair_ratio": 0.0, "smooth_k": False})
    assert torch.equal(plain, openvc_kernels.reference_attention(q, k, v, repair_ratio=0.0, window=4))


@pytest.mark.parametrize("name,value", [("layer", "3"), ("layer", -1), ("step", 2.0), ("step", True)])
def test_attention_function_takes_int_layer_and_step(name, value):
    """A layer "3" would never match bf16_layers' 3: the call would take Open-VC without a word."""
    q = torch.randn(1, 300, 2, 128)
    with pytest.raises(ValueError, match=rf"{name} must be an int >= 0 or None, got {re.escape(repr(value))}"):
        openvc_diffusers.attention(q, q, q, {"min_tokens": 0, "bf16_layers": [3]}, **{name: value})
    with pytest.raises(ValueError, match=r"is_cross must be True, False or None \(k not as long as q\), got 'no'"):
        openvc_diffusers.attention(q, q, q, is_cross="no")


def test_torch_compile_of_the_transformer_gives_the_eager_output():
    model, inputs = tiny_wan_transformer(), tiny_wan_inputs()
    openvc_diffusers.apply(model, {"min_tokens": 0})
    with torch.no_grad():
        eager = model(**inputs)[0]
        # aot_eager traces everything torch.compile traces, without a C++ toolchain for inductor.
        compiled = torch.compile(model, backend="aot_eager")(**inputs)[0]
    assert torch.equal(compiled, eager)


def test_bf16_steps_without_step_tracking_raise_at_the_first_call():
    model, inputs = tiny_wan_transformer(), tiny_wan_inputs()
    model.set_attn_processor(OpenVCProcessor({"min_tokens": 0, "bf16_steps": [0, 1]}))
    with pytest.raises(RuntimeError, match=r"bf16_steps \[0-1\] needs denoising-step tracking.*apply"):
        with torch.no_grad():
            model(**inputs)


@pytest.mark.parametrize("route", ["set_attn_processor", "apply, compiled"])
def test_bf16_layers_past_the_model_are_reported_once(route, caplog, fresh_dynamo, monkeypatch):
    monkeypatch.setattr(attention_module, "_said", set())  # each route says it once
    model, inputs = tiny_wan_transformer(), tiny_wan_inputs()  # 2 self-attention layers
    config = {"min_tokens": 0, "bf16_layers": [1, 5, "7-9"]}
    if route == "set_attn_processor":
        processor = OpenVCProcessor(config)
        model.set_attn_processor(processor)
    else:
        processor = openvc_diffusers.apply(model, config)
        model = torch.compile(model, backend="aot_eager")
    with caplog.at_level(logging.WARNING, logger="openvc_diffusers"), torch.no_grad():
        for _ in range(3):
            model(**inputs)
    messages = [r.getMessage() for r in caplog.records if "past this model" in r.getMessage()]
    assert messages == [
        "Open-VC: bf16_layers 5, 7-9 are past this model's 2 self-attention layers (0-1); those entries match no call"
    ]
    assert processor.calls[SELF, "sdpa"] == 3  # layer 1, in each of the three forwards
