"""The processor's Python side under torch.compile and CUDA-graph capture, on the CPU: compiled forwards are
counted and trace into one graph, compiled once per routing rather than once per call or per step, and step
tracking leaves a capture alone. tests/test_gpu_diffusers.py runs the model on the Hopper kernel."""

import importlib
import logging

import pytest
import torch
from diffusers.models.attention_dispatch import attention_backend
from torch._dynamo.testing import CompileCounter

import openvc_diffusers
import openvc_kernels
from openvc_diffusers import OpenVCProcessor, backends, policy
from openvc_diffusers.tiny import tiny_wan_inputs, tiny_wan_transformer

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_dynamo")

# The module, not the attention() function that the package exports under the same name.
attention_module = importlib.import_module("openvc_diffusers.attention")

SELF, CROSS, OPENVC, SDPA = "self", "cross", "openvc-reference", "sdpa"


def run_steps(model, inputs, timesteps) -> None:
    with torch.no_grad():
        for timestep in timesteps:
            model(**{**inputs, "timestep": torch.tensor([timestep])})


def test_compiled_forwards_are_counted_in_one_graph_without_recompiling(caplog, monkeypatch):
    monkeypatch.setattr(attention_module, "_said", set())  # the reference's warning is logged while tracing
    model, inputs = tiny_wan_transformer(), tiny_wan_inputs()
    processor = openvc_diffusers.apply(model, {"min_tokens": 0})
    backend = CompileCounter()
    compiled = torch.compile(model, backend=backend)
    # apply numbered the layers: a guard on a count, a layer or the step would fail here, and the error would name it.
    with caplog.at_level(logging.WARNING, "openvc_diffusers"), torch._dynamo.config.patch(error_on_recompile=True):
        run_steps(compiled, inputs, [900, 800, 700, 600])
    assert processor.calls == {(SELF, OPENVC): 8, (CROSS, SDPA): 8}
    assert backend.frame_count == 1
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    assert [r.getMessage() for r in caplog.records] == [attention_module.REFERENCE_WARNING]


def test_compiled_bf16_steps_recompile_only_where_the_routing_changes():
    model, inputs = tiny_wan_transformer(), tiny_wan_inputs()
    processor = openvc_diffusers.apply(model, {"min_tokens": 0, "bf16_steps": [1]})
    run_steps(model, inputs, [900])  # step 0, eagerly: the layers are numbered before compiling
    backend = CompileCounter()
    run_steps(torch.compile(model, backend=backend), inputs, [800, 700, 600, 500])
    assert processor.step == 4
    assert processor.calls == {(SELF, OPENVC): 8, (SELF, SDPA): 2, (CROSS, SDPA): 10}
    assert backend.frame_count == 2  # step 1 has its own graph; steps 2, 3 and 4 share one


def test_compiled_calls_of_a_processor_set_by_hand_go_uncounted_without_recompiling():
    # Nothing empties the compiled forwards' counts between forwards without apply's pre-hook.
    model, inputs = tiny_wan_transformer(), tiny_wan_inputs()
    processor = OpenVCProcessor({"min_tokens": 0})
    model.set_attn_processor(processor)
    run_steps(model, inputs, [900])  # eagerly: the layers are numbered before compiling
    backend = CompileCounter()
    with torch._dynamo.config.patch(error_on_recompile=True):
        run_steps(torch.compile(model, backend=backend), inputs, [800, 700])
    assert processor.calls == {(SELF, OPENVC): 2, (CROSS, SDPA): 2}
    assert backend.frame_count == 1


def test_step_tracking_leaves_a_cuda_graph_capture_alone(monkeypatch):
    # Under capture, reading a CUDA timestep would synchronise, which capture forbids.
    model = tiny_wan_transformer()
    tracker = openvc_diffusers.apply(model, {"bf16_steps": [0]}).step_tracker
    tracker(model, (), {"timestep": torch.tensor([900])})
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    tracker(model, (), {"timestep": torch.tensor([800])})
    assert (tracker.step, tracker.watched_step) == (0, 0)
    monkeypatch.undo()
    tracker(model, (), {"timestep": torch.tensor([800])})
    assert (tracker.step, tracker.watched_step) == (1, None)


def untraceable(answer):
    def lookup(*args):
        torch._dynamo.graph_break()
        return answer

    return lookup


def test_package_lookups_are_evaluated_not_traced(monkeypatch):
    # Both checks look packages up with importlib's find_spec, which torch 2.11 cannot trace; a graph break here
    # would fail fullgraph.
    monkeypatch.setattr(openvc_kernels, "kernel_unavailable_reason", untraceable("no kernel here"))
    monkeypatch.setattr(backends, "_fa4_found", untraceable(True))

    config = openvc_diffusers.load_config({"repair_ratio": 0.01})

    # dynamic=True: the options are read from the config as the policy reads them, where its float would be symbolic.
    @torch.compile(backend="eager", fullgraph=True, dynamic=True)
    def checks(q):
        kernel = policy.kernel_unavailable_reason(q.device, q.dtype, 128, config.kernel_options_text)
        return q + 1, kernel, backends.fa4_installed()

    assert checks(torch.zeros(2, 128))[1:] == ("no kernel here", True)


@pytest.fixture
def through_the_backend():
    """Route a model's attention through the "openvc" backend alone (no Open-VC processor), as diffusers users do;
    the import's registration and diffusers' native backend afterwards."""

    def route(model, config):
        openvc_diffusers.register(config)
        model.set_attention_backend("openvc")

    with attention_backend("native"):  # set_attention_backend also sets the process-wide backend (diffusers#14249)
        yield route
    openvc_diffusers.register()


def eager_outputs(model, inputs, timesteps) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(**{**inputs, "timestep": torch.tensor([t])})[0] for t in timesteps]


@pytest.mark.parametrize("route", ["processor", "backend"])
def test_repeated_blocks_compile_once_for_every_block_and_step(route, through_the_backend):
    # compile_repeated_blocks compiles one block's code for all blocks: whatever the traced code reads must not change
    # from block to block (the layer numbering did, and the compiled calls' counts) nor from step to step.
    model, inputs = tiny_wan_transformer(), tiny_wan_inputs()
    if route == "processor":
        processor = openvc_diffusers.apply(model, {"min_tokens": 0})
    else:
        through_the_backend(model, {"min_tokens": 0})
    eager = eager_outputs(model, inputs, [900, 800, 700])
    backend = CompileCounter()
    model.compile_repeated_blocks(fullgraph=True, backend=backend)
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = eager_outputs(model, inputs, [900, 800, 700])
    assert backend.frame_count == 1
    assert all(torch.equal(c, e) for c, e in zip(compiled, eager))
    if route == "processor":
        assert processor.calls == {(SELF, OPENVC): 12, (CROSS, SDPA): 12}  # eager and compiled, 3 steps x 2 layers each


def test_whole_model_compiles_into_one_dynamic_graph_with_the_backend(through_the_backend):
    model, inputs = tiny_wan_transformer(), tiny_wan_inputs()
    through_the_backend(model, {"min_tokens": 0})
    eager = eager_outputs(model, inputs, [900, 800, 700])
    backend = CompileCounter()
    compiled_model = torch.compile(model, fullgraph=True, dynamic=True, backend=backend)
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = eager_outputs(compiled_model, inputs, [900, 800, 700])
    assert backend.frame_count == 1
    assert all(torch.equal(c, e) for c, e in zip(compiled, eager))


def test_kernel_api_traces_whole_with_symbolic_floats():
    """With dynamic=True the floats a compiled function is called with are symbolic: the kernel API still traces
    into one graph (no check of their values while tracing) and its op checks them when it runs. On the CPU the
    op then refuses the device, or first names a bad ratio. The op's float arguments are specialized: one graph per
    ratio (a model keeps its ratio), the same ratio again compiles nothing."""

    def call(q, rho):
        return openvc_kernels.attention(q, q, q, repair_ratio=rho)

    backend = CompileCounter()
    compiled = torch.compile(call, backend=backend, dynamic=True, fullgraph=True)
    q = torch.randn(1, 256, 2, 128, dtype=torch.bfloat16)
    for _ in range(2):
        with pytest.raises(ValueError, match="runs on CUDA devices, inputs are on cpu"):
            compiled(q, 0.005)
    assert backend.frame_count == 1
    with pytest.raises(ValueError, match=r"repair_ratio must be a finite number in \[0, 0.5\], got -1.0"):
        compiled(q, -1.0)
