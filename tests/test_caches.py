"""Layer and step numbers under diffusers' caches, which skip blocks (First Block Cache) or attention calls
(Pyramid Attention Broadcast) on some steps: the policy must still see each call's own layer and step."""

import pytest
import torch
from diffusers import FirstBlockCacheConfig, PyramidAttentionBroadcastConfig

import openvc_diffusers
from openvc_diffusers import backend
from openvc_diffusers.tiny import tiny_wan_inputs, tiny_wan_transformer

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIG = {"min_tokens": 0, "bf16_layers": [1], "bf16_steps": [2]}
TIMESTEPS = (900, 800, 700, 600)


@pytest.fixture
def decisions(monkeypatch):
    """Every self-attention call's (step, layer, backend) as the policy saw it: watched values only, so a layer not in
    bf16_layers and a step not in bf16_steps read None."""
    seen = []

    def recording(config, call):
        decision = decide(config, call)
        if not call.is_cross:
            seen.append((call.step, call.layer, decision.backend))
        return decision

    decide = backend.decide
    monkeypatch.setattr(backend, "decide", recording)
    return seen


def run_steps(model, inputs, on_step=lambda t: None) -> None:
    with torch.no_grad():
        for timestep in TIMESTEPS:
            on_step(timestep)
            with model.cache_context("cond"):  # as pipelines call the transformer
                model(**{**inputs, "timestep": torch.tensor([timestep])})


def test_first_block_cache_skips_blocks_not_numbers(decisions):
    model, inputs = tiny_wan_transformer(), tiny_wan_inputs()
    processor = openvc_diffusers.apply(model, CONFIG)
    # Any change of the first block's residual is below this threshold: from step 1 on, only block 0 runs.
    model.enable_cache(FirstBlockCacheConfig(threshold=1e9))
    run_steps(model, inputs)
    assert decisions == [
        (None, None, "openvc-reference"),  # step 0: layer 0 on Open-VC, layer 1 in BF16
        (None, 1, "sdpa"),
        (None, None, "openvc-reference"),  # step 1: block 0 only
        (2, None, "sdpa"),  # step 2 in BF16
        (None, None, "openvc-reference"),  # step 3
    ]
    assert processor.step == len(TIMESTEPS) - 1


def test_pyramid_attention_broadcast_skips_calls_not_numbers(decisions):
    model, inputs = tiny_wan_transformer(), tiny_wan_inputs()
    processor = openvc_diffusers.apply(model, CONFIG)
    timestep = [None]
    # Self-attention computed at every other step (0 and 2), broadcast at 1 and 3; cross-attention left alone.
    model.enable_cache(
        PyramidAttentionBroadcastConfig(
            spatial_attention_block_skip_range=2,
            spatial_attention_timestep_skip_range=(0, 1000),
            spatial_attention_block_identifiers=("attn1",),
            current_timestep_callback=lambda: timestep[0],
        )
    )
    run_steps(model, inputs, on_step=lambda t: timestep.__setitem__(0, t))
    assert decisions == [
        (None, None, "openvc-reference"),  # step 0
        (None, 1, "sdpa"),
        (2, None, "sdpa"),  # step 2 in BF16, both layers
        (2, 1, "sdpa"),
    ]
    assert processor.step == len(TIMESTEPS) - 1
