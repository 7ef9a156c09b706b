"""``openvc_kernels.attention``'s host side on the CPU: an eager call checks its arguments once and runs the custom
op's body itself; wherever something would see the op (autograd, a mode, a transform, the profiler), the call goes
through the op. The kernel's own runs are in tests/test_sm90_gpu.py."""

import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from openvc_kernels import attention, ops


@pytest.fixture
def calls(monkeypatch):
    """Stand-ins for the checks and the op's body that record how a call reached them (the body: through the op,
    "op", or directly, "direct") and answer a bf16 output of q's shape."""
    seen = []

    def checks(*args):
        seen.append("checks")

    def body(route):
        def run(q, *args):
            seen.append(route)
            out = torch.randn(q.shape).bfloat16()
            return (out, torch.randn(q.shape[:3])) if args[-1] else out

        return run

    monkeypatch.setattr(ops, "_check_kernel_args", checks)
    monkeypatch.setattr(ops, "_run_checked", body("direct"))
    monkeypatch.setattr(ops, "_run", body("op"))
    return seen


def _inputs(requires_grad=False):
    return [torch.randn(1, 64, 2, 128, dtype=torch.bfloat16, requires_grad=requires_grad) for _ in range(3)]


@pytest.mark.parametrize("return_lse", [False, True])
def test_an_eager_call_is_checked_once_and_runs_the_body(calls, return_lse):
    attention(*_inputs(), smooth_k=True, repair_ratio=0.01, return_lse=return_lse)
    assert calls == ["checks", "direct"]


def test_inputs_that_need_no_gradient_here_run_the_body(calls):
    with torch.no_grad():
        attention(*_inputs(requires_grad=True))
    assert calls == ["checks", "direct"]


def test_a_call_autograd_records_goes_through_the_op_and_its_backward_raises(calls):
    out = attention(*_inputs(requires_grad=True))
    assert calls == ["checks", "op"]
    with pytest.raises(RuntimeError, match="forward-only"):
        out.float().sum().backward()


def test_a_call_under_a_function_mode_goes_through_the_op(calls):
    with torch.device("cpu"):
        attention(*_inputs())
    assert calls == ["checks", "op"]


@pytest.mark.parametrize("return_lse", [False, True])
def test_a_profile_names_the_op_around_its_body(calls, return_lse):
    with torch.profiler.profile() as watch:
        attention(*_inputs(), return_lse=return_lse)
    assert calls == ["checks", "direct"]
    name = "openvc::attention_lse" if return_lse else "openvc::attention"
    assert name in {event.name for event in watch.events()}


def test_fake_tensors_get_the_op_s_fake_output(calls):
    with FakeTensorMode() as mode:
        q, k, v = (mode.from_tensor(x) for x in _inputs())
        out = attention(q, k, v)
    assert calls == ["checks"] and out.shape == q.shape and out.dtype == torch.bfloat16


def test_a_functorch_transform_goes_through_the_op(calls):
    """vmap sees the op (it runs the op once per slice, having no batching rule for it), never the kernel's
    launches on batched tensors."""
    q, k, v = (torch.stack([x, x]) for x in _inputs())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's performance warning (a C++ one on some torch versions)
        out = torch.vmap(lambda a, b, c: attention(a, b, c))(q, k, v)
    assert calls == ["checks", "op", "op"] and out.shape == q.shape
