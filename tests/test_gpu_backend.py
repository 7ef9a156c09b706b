"""The "openvc" diffusers attention backend on a Hopper GPU (skipped elsewhere; tests/test_compile.py and
tests/test_backend.py run the same Python side on the CPU, on the reference).

A Wan-shaped transformer, bfloat16 as ``from_pretrained`` loads it, deeper than dynamo's recompile limit (8): 10 layers
of 4 heads x 128 on 1024 video tokens, so every self-attention call runs the FP8 kernel. Through
``set_attention_backend("openvc")`` its self-attention takes the kernel and its output is our processor's, bit for
bit; compiled the way diffusers tests attention backends (``compile_repeated_blocks(fullgraph=True)``,
``torch.compile(fullgraph=True, dynamic=True)``) it has no graph break and compiles once for every block and step.
"""

import pytest
import torch
from helpers import needs_hopper
from diffusers import WanTransformer3DModel
from diffusers.models.attention_dispatch import attention_backend
from torch._dynamo.testing import CompileCounterWithBackend

import openvc_diffusers
from openvc_diffusers import backend
from openvc_diffusers.metrics import rel_l2
from openvc_diffusers.policy import OPENVC_KERNEL, SDPA
from openvc_diffusers.tiny import cast_like_from_pretrained

pytestmark = [
    pytest.mark.gpu,
    needs_hopper,
    pytest.mark.usefixtures("fresh_dynamo"),
]

DEVICE = "cuda"
LAYERS, HEADS = 10, 4
LATENTS = (1, 16, 4, 32, 32)
"""(batch, channels, frames, height, width): with patch (1, 2, 2), 4 x 16 x 16 = 1024 video tokens."""
TEXT_TOKENS, TEXT_DIM = 512, 64
TIMESTEPS = (900.0, 800.0, 700.0)
CALLS_PER_FORWARD = {("self", OPENVC_KERNEL): LAYERS, ("cross", SDPA): LAYERS}
FP8_REL_L2 = 0.05
"""Open-VC against stock attention at the model's output, as tests/test_families.py holds the CPU reference."""
INDUCTOR_REL_L2 = 2e-2
"""Inductor's bf16 fusions against eager (tests/test_gpu_diffusers.py measured why)."""


@pytest.fixture
def wan():
    """The transformer and one input per timestep; the import's registration and diffusers' native backend after."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=HEADS, attention_head_dim=128, in_channels=LATENTS[1],
            out_channels=LATENTS[1], text_dim=TEXT_DIM, freq_dim=256, ffn_dim=1024, num_layers=LAYERS,
            cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
        )  # fmt: skip
    model = cast_like_from_pretrained(model, torch.bfloat16).to(DEVICE).eval()
    g = torch.Generator(DEVICE).manual_seed(1)
    text = torch.randn(1, TEXT_TOKENS, TEXT_DIM, generator=g, device=DEVICE, dtype=torch.bfloat16)
    inputs = [
        dict(
            hidden_states=torch.randn(LATENTS, generator=g, device=DEVICE, dtype=torch.bfloat16),
            timestep=torch.tensor([t], device=DEVICE),
            encoder_hidden_states=text,
            return_dict=False,
        )
        for t in TIMESTEPS
    ]
    # set_attention_backend also sets the process-wide backend (diffusers#14249): put the native one back after.
    with attention_backend("native"):
        yield model, inputs
    openvc_diffusers.register()


def outputs(model, inputs) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(**x)[0] for x in inputs]


def through_the_backend(model) -> None:
    openvc_diffusers.register({"min_tokens": 0})
    model.set_attention_backend("openvc")


def test_backend_runs_self_attention_on_the_kernel_as_our_processor_does(wan):
    model, inputs = wan
    stock = outputs(model, inputs[:1])[0]
    through_the_backend(model)
    ours = outputs(model, inputs[:1])[0]
    assert backend.calls() == CALLS_PER_FORWARD
    assert 0 < rel_l2(ours, stock) < FP8_REL_L2
    model.reset_attention_backend()
    processor = openvc_diffusers.apply(model, {"min_tokens": 0})
    assert torch.equal(outputs(model, inputs[:1])[0], ours)
    assert processor.calls == CALLS_PER_FORWARD


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
@pytest.mark.parametrize("route", ["processor", "backend"])
def test_repeated_blocks_compile_once_for_every_block_and_step(wan, route, compiler):
    # The processor route recompiled at every block before (issue 18: dynamo's [23/8] warning on a 30-layer model).
    model, inputs = wan
    if route == "processor":
        processor = openvc_diffusers.apply(model, {"min_tokens": 0})
    else:
        through_the_backend(model)
    eager = outputs(model, inputs)
    counter = CompileCounterWithBackend(compiler)
    model.compile_repeated_blocks(fullgraph=True, backend=counter)
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = outputs(model, inputs)
    assert counter.frame_count == 1
    for c, e in zip(compiled, eager):
        assert torch.equal(c, e) if compiler == "aot_eager" else rel_l2(c, e) < INDUCTOR_REL_L2
    if route == "processor":
        assert processor.calls == {key: 2 * len(TIMESTEPS) * n for key, n in CALLS_PER_FORWARD.items()}


def test_whole_model_compiles_into_one_dynamic_graph_with_the_backend(wan):
    model, inputs = wan
    through_the_backend(model)
    eager = outputs(model, inputs)
    counter = CompileCounterWithBackend("inductor")
    compiled_model = torch.compile(model, fullgraph=True, dynamic=True, backend=counter)
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = outputs(compiled_model, inputs)
    # Not counter.frame_count: with dynamic=True, torch 2.11's inductor restarts the analysis once (its
    # tensorify_python_scalars pass), which calls the backend twice for the one graph; stock attention does the same.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert not torch._dynamo.utils.counters["graph_break"]
    assert all(rel_l2(c, e) < INDUCTOR_REL_L2 for c, e in zip(compiled, eager))
