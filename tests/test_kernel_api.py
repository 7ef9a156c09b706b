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


@pytest.mark.parametrize(
    "rotary,message",
    [
        ("tables", "rotary must be a (cos, sin) pair, got str"),
        ((torch.zeros(1, 64, 1, 128), None), "rotary holds Tensor, NoneType"),
        ((torch.zeros(1, 63, 1, 128), torch.zeros(1, 63, 1, 128)), "cos is (1, 63, 1, 128) torch.float32 on cpu, not"),
        ((torch.zeros(1, 64, 1, 128).double(), torch.zeros(1, 64, 1, 128)), "cos is (1, 64, 1, 128) torch.float64"),
    ],
    ids=["not a pair", "not tensors", "another length", "float64"],
)
def test_bad_rotary_tables_raise_before_any_work(calls, rotary, message):
    """``rotary`` is checked with the other arguments, before the body runs: the error names what came and what
    is accepted."""
    with pytest.raises(ValueError, match="accepted: None, or \\(cos, sin\\)") as caught:
        attention(*_inputs(), rotary=rotary)
    assert message in str(caught.value)
    assert calls == ["checks"]


def test_rotary_tables_need_q_and_k_of_one_shape(calls):
    q, k, v = _inputs()
    tables = (torch.zeros(1, 64, 1, 128), torch.zeros(1, 64, 1, 128))
    with pytest.raises(ValueError, match="k is \\(1, 32, 2, 128\\) torch.bfloat16 on cpu, q \\(1, 64, 2, 128\\)"):
        attention(q, k[:, :32], v[:, :32], rotary=tables)
    attention(q, k, v, rotary=tables)
    assert calls == ["checks", "checks", "direct"]


@pytest.mark.parametrize(
    "options,inside",
    [
        ({}, True),
        ({"smooth_k": True, "repair_ratio": 0.005}, True),
        ({"return_lse": True}, False),
        ({"repair_ratio": 0.01, "repair_ranking": "attention"}, False),
        ({"k_mean": "given"}, False),
    ],
    ids=["API", "defaults", "lse", "attention ranking", "k_mean given"],
)
def test_q_and_k_rotate_inside_the_preparation_only_where_nothing_else_reads_them(monkeypatch, options, inside):
    """``_run_checked``: the tables go to the preparation, q and k unrotated, unless the lse, the "attention" ranking
    or shared scales need the rotated q and k; then ``rotate_qk`` runs first and the preparation gets no tables."""
    q, k, v = _inputs()
    tables = (torch.randn(1, 64, 1, 128), torch.randn(1, 64, 1, 128))
    options = dict(options)
    if options.get("k_mean") == "given":
        options["k_mean"] = torch.randn(1, 2, 128)
    seen = {}
    monkeypatch.setattr(ops, "rotate_qk", lambda q, k, cos, sin: (q + 1, k + 1))
    monkeypatch.setattr(
        ops, "_prepare_checked", lambda q, k, v, options, v_absmax, k_mean, rotary: seen.update(q=q, rotary=rotary)
    )
    monkeypatch.setattr(
        ops, "_attention_prepared_checked",
        lambda prepared, out, *args: (out, torch.zeros(1, 2, 64).transpose(1, 2)) if args[-1] else out,
    )
    monkeypatch.setattr(ops, "smoothing_lse_shift", lambda *args: 0)
    ops._run_checked(
        q, k, v, 128**-0.5, 4, options.get("smooth_k", False), options.get("repair_ratio", 0.0),
        options.get("repair_ranking", "energy"), None, options.get("k_mean"), tables, options.get("return_lse", False),
    )
    assert (seen["rotary"] is tables) == inside and (seen["q"] is q) == inside
    assert inside or torch.equal(seen["q"], q + 1)
