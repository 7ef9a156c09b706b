"""The rotary embedding Open-VC's Wan processor hands to the backend (``openvc_kernels.rotary``): the reference is
diffusers' arithmetic bit for bit, the processor's output is the same with it as with diffusers' code, the kernel
compiles for sm_90a with the reference's roundings (CPU), and on a Hopper GPU writes the reference's bits, also on
HunyuanVideo's tables, where it stands in for diffusers' ``apply_rotary_emb`` (``processors/hunyuan.py``)."""

import collections
import importlib
import json
import logging
import os
import re
import subprocess
import sys

import pytest
import torch
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoRotaryPosEmbed
from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed
from helpers import PTXAS_REMARKS, needs_hopper, poisoned_prepared, ptxas_spills

import openvc_diffusers
from openvc_diffusers import backend
from openvc_diffusers.policy import FA4, OPENVC_KERNEL, SDPA, Decision
from openvc_diffusers.processors import hunyuan, wan
from openvc_diffusers.tiny import cast_like_from_pretrained, tiny_wan_inputs, tiny_wan_transformer
from openvc_kernels import rotary
from openvc_kernels.rotary import kernel_rotary_reason, rotary_reference, rotate_qk

attention = importlib.import_module("openvc_diffusers.attention")
"""The module (the package's ``attention`` is its function)."""

def _angles(seq_len: int, device="cpu") -> torch.Tensor:
    """Random float64 angles, one per token and channel pair: (S, 64)."""
    return torch.rand(seq_len, 64, dtype=torch.float64, device=device) * 100


def _tables(angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The (1, S, 1, 128) FP32 cos and sin tables of ``angles``, each pair's two entries equal, as diffusers'
    repeat_interleave writes them."""
    shape = (1, angles.shape[0], 1, 128)
    return tuple(f(angles).repeat_interleave(2, dim=-1).float().view(shape) for f in (torch.cos, torch.sin))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_processor_output_is_the_same_with_the_backend_rotating(fresh_seed, one_thread, monkeypatch, dtype):
    """The tiny Wan's forward, in inference: the backend rotating Q and K gives diffusers' output bit for bit, and
    it does rotate them (once per self-attention call; here, off Hopper, in ``attention.run`` before the
    reference)."""
    model = cast_like_from_pretrained(tiny_wan_transformer(seed=fresh_seed), dtype)
    openvc_diffusers.apply(model, {"min_tokens": 0})
    inputs = tiny_wan_inputs()
    for name in ("hidden_states", "encoder_hidden_states"):
        inputs[name] = torch.randn_like(inputs[name]).to(dtype)
    rotated = []
    monkeypatch.setattr(attention, "rotate_qk", lambda *args: rotated.append(args[0].shape) or rotate_qk(*args))
    with torch.no_grad():
        ours = model(**inputs)[0]
        assert len(rotated) == len(model.blocks)
        monkeypatch.setattr(wan, "backend_rotates", lambda *args: False)
        theirs = model(**inputs)[0]
    assert len(rotated) == len(model.blocks)
    assert torch.equal(ours, theirs)


def test_the_backend_rotates_only_self_attention_in_eager_inference(monkeypatch):
    tables = _tables(_angles(4))
    with torch.no_grad():
        assert wan.backend_rotates(tables, is_cross=False)
        assert not wan.backend_rotates(tables, is_cross=True)
        assert not wan.backend_rotates(None, is_cross=False)
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        assert not wan.backend_rotates(tables, is_cross=False)
    monkeypatch.undo()
    with torch.enable_grad():
        assert not wan.backend_rotates(tables, is_cross=False)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_reference_rotates_each_pair(fresh_seed, dtype):
    """Against the rotation in float64 complex numbers: each pair (x1, x2) turned by its angle, and the norm kept,
    to the input dtype's rounding."""
    seq_len, heads = 37, 3
    x = torch.randn(2, seq_len, heads, 128).to(dtype)
    angles = _angles(seq_len)
    cos, sin = _tables(angles)
    pairs = torch.view_as_complex(x.double().unflatten(-1, (-1, 2)).contiguous())
    turned = pairs * torch.polar(torch.ones_like(angles), angles).view(1, seq_len, 1, 64)
    expected = torch.view_as_real(turned).flatten(-2)
    out = rotary_reference(x, cos, sin)
    assert out.dtype == dtype and out.shape == x.shape
    ulp = torch.finfo(dtype).eps
    assert ((out.double() - expected).abs() <= 2 * ulp * expected.abs().clamp_min(1e-3) + 1e-6).all()


def test_rotate_qk_falls_back_to_the_reference_off_hopper(fresh_seed):
    q, k = torch.randn(2, 1, 10, 2, 128, dtype=torch.bfloat16)
    cos, sin = _tables(_angles(10))
    assert kernel_rotary_reason(q, k, cos, sin) is not None
    out_q, out_k = rotate_qk(q, k, cos, sin)
    assert torch.equal(out_q, rotary_reference(q, cos, sin)) and torch.equal(out_k, rotary_reference(k, cos, sin))


def test_kernel_rotary_reason_names_what_the_kernel_cannot_take(monkeypatch):
    monkeypatch.setattr(rotary, "kernel_unavailable_reason", lambda *args: None)
    monkeypatch.setattr(rotary, "rotary_build_failure", lambda dtype: None)
    q = torch.zeros(1, 10, 2, 128, dtype=torch.bfloat16)
    cos, sin = _tables(_angles(10))
    assert kernel_rotary_reason(q, q, cos, sin) is None
    assert kernel_rotary_reason(q[0], q[0], cos, sin) == "q has 3 dims, not (B, S, H, D)"
    assert kernel_rotary_reason(q, q.half(), cos, sin).startswith("k is (1, 10, 2, 128) torch.float16 on cpu")
    assert kernel_rotary_reason(q, q, cos[:, :9], sin) == (
        "cos is (1, 9, 1, 128) torch.float32 on cpu, not (1, 10, 1, 128) torch.float32 on cpu"
    )
    assert kernel_rotary_reason(q, q, cos, sin.double()).startswith("sin is (1, 10, 1, 128) torch.float64")


_PTX_SCRIPT = """
import collections, json, re, torch
from openvc_kernels.rotary import compile_rotary
out = {}
for name in ("float16", "bfloat16"):
    ptx = compile_rotary(getattr(torch, name)).artifacts.PTX
    out[name] = {
        "ops": collections.Counter(re.findall(r"^\\s+(?:@%p\\d+\\s+)?([a-z][a-z0-9_.:]*)", ptx, re.M)),
        "target": re.search(r"\\.target\\s+(\\S+)", ptx).group(1),
    }
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def rotary_ptx(tmp_path_factory) -> dict:
    """``RotaryQK`` compiled for sm_90a in a fresh process (no GPU needed): its PTX opcode counts per dtype, and
    ptxas's spills (``helpers.ptxas_spills``) under "spills"."""
    dump = tmp_path_factory.mktemp("rotary_ptx")
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=str(dump), **PTXAS_REMARKS)
    done = subprocess.run([sys.executable, "-c", _PTX_SCRIPT], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "spills": ptxas_spills(done.stderr)}


def test_kernel_spills_no_registers(rotary_ptx):
    """ptxas's own spills, which the PTX's ld.local / st.local counts cannot see: none, for either dtype."""
    assert [report[1:] for report in rotary_ptx["spills"]] == [(0, 0), (0, 0)]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_kernel_compiles_with_the_references_roundings(rotary_ptx, dtype):
    """Per head and tensor a thread rotates 4 tokens x 8 pairs: 4 products each rounded alone (mul.rn, never an
    FMA), one subtraction and one addition per pair, then RNE to the input dtype two values at a time; Q and K
    read and written with 16-byte accesses, nothing spilled."""
    compiled = rotary_ptx[dtype]
    ops = collections.Counter(compiled["ops"])
    assert compiled["target"] == "sm_90a"
    count = lambda prefix: sum(n for op, n in ops.items() if op.startswith(prefix))
    pairs = 2 * 4 * 8  # Q and K, 4 tokens, 8 pairs
    assert ops["mul.rn.f32"] == 4 * pairs and count("fma") == 0
    assert ops["sub.f32"] == pairs and ops["add.f32"] == pairs
    short = "f16" if dtype == "float16" else "bf16"
    assert ops[f"cvt.rn.{short}x2.f32"] == pairs and ops[f"cvt.f32.{short}"] == 2 * pairs
    assert ops["st.global.v4.b32"] == 2 * 4 * 2 and count("st.global") == ops["st.global.v4.b32"]
    assert count("ld.local") == 0 and count("st.local") == 0, "registers spilled"
    assert count("bar") == 0 and count("shfl") == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("batch,seq_len,heads", [(1, 32760, 12), (2, 1000, 3), (1, 127, 1), (1, 75600, 2)])
@pytest.mark.gpu
@needs_hopper
def test_kernel_writes_the_references_bits(fresh_seed, dtype, batch, seq_len, heads):
    """Every byte of both outputs, poisoned before the launch; q and k views with strides of their own (heads
    interleaved in a larger tensor), the tables a view into a longer sequence's (as context parallelism splits them)."""
    both = torch.randn(batch, seq_len, 2, heads, 128, device="cuda").to(dtype)
    q, k = both[:, :, 0], both[:, :, 1]
    cos, sin = (t[:, 5 : 5 + seq_len] for t in _tables(_angles(seq_len + 9, device="cuda")))
    outs = [torch.full_like(q, float("nan")).contiguous() for _ in range(2)]
    rotary.load_rotary(dtype)(q, k, cos[0, :, 0], sin[0, :, 0], *outs)
    assert torch.equal(outs[0], rotary_reference(q, cos, sin))
    assert torch.equal(outs[1], rotary_reference(k, cos, sin))


@pytest.mark.gpu
@needs_hopper
def test_rotate_qk_on_hopper_takes_wans_own_tables(fresh_seed):
    """rotate_qk through its launch (checked: the reason is None) on the tables of diffusers' Wan RoPE for Wan 480p's
    21 x 60 x 104 latent (32,760 tokens), the reference's bits."""
    rope = WanRotaryPosEmbed(attention_head_dim=128, patch_size=(1, 2, 2), max_seq_len=1024).cuda()
    cos, sin = rope(torch.randn(1, 16, 21, 60, 104, device="cuda"))
    q, k = torch.randn(2, 1, cos.shape[1], 2, 128, device="cuda", dtype=torch.bfloat16)
    assert kernel_rotary_reason(q, k, cos, sin) is None
    out_q, out_k = rotate_qk(q, k, cos, sin)
    assert torch.equal(out_q, rotary_reference(q, cos, sin)) and torch.equal(out_k, rotary_reference(k, cos, sin))


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("layout", ["whole", "video part of a joint sequence"])
def test_hunyuan_video_rope_rotates_in_one_launch(fresh_seed, layout):
    """The HunyuanVideo processors' rotation (``hunyuan.rotate_video_tokens``) on diffusers' HunyuanVideo RoPE for a
    33 x 30 x 52 latent grid (51,480 tokens), through the launch (``launch_rotates``, the reason None): diffusers'
    ``apply_rotary_emb`` bit for bit, also on the video tokens sliced from a joint [video, text] sequence."""
    rope = HunyuanVideoRotaryPosEmbed(patch_size=2, patch_size_t=1, rope_dim=[16, 56, 56])
    cos, sin = rope(torch.empty(1, 16, 33, 60, 104, device="cuda"))
    text = 256 if layout != "whole" else 0
    joint = torch.randn(2, 1, cos.shape[0] + text, 3, 128, device="cuda", dtype=torch.bfloat16)
    q, k = (x[:, : cos.shape[0]] for x in joint)
    with torch.no_grad():
        assert hunyuan.launch_rotates(q, cos, sin)
        assert kernel_rotary_reason(q, k, cos[None, :, None], sin[None, :, None]) is None
        ours = hunyuan.rotate_video_tokens(q, k, (cos, sin))
    for got, x in zip(ours, (q, k)):
        assert torch.equal(got, apply_rotary_emb(x, (cos, sin), sequence_dim=1))


def test_the_kernel_route_takes_the_tables_and_every_other_backend_rotates_first(monkeypatch):
    """``attention.run``: a call the policy sends to the kernel passes q and k unrotated with the tables (the
    preparation rotates them); FA4 and SDPA get q and k rotated first, the reference's bits."""
    q, k, v = (torch.randn(1, 16, 2, 128, dtype=torch.bfloat16) for _ in range(3))
    tables = _tables(_angles(16))
    config = openvc_diffusers.load_config(None)
    seen = {}

    def record(name):
        def run(q, k, v, *args, **kwargs):
            seen[name] = (q, k, kwargs)
            return torch.zeros_like(q)

        return run

    monkeypatch.setattr(attention.openvc_kernels, "attention", record("kernel"))
    monkeypatch.setattr(attention, "run_fa4", record(FA4))
    monkeypatch.setattr(attention, "run_sdpa", record(SDPA))
    attention.run(Decision(OPENVC_KERNEL), config, q, k, v, rotary=tables)
    got_q, got_k, kwargs = seen["kernel"]
    assert got_q is q and got_k is k and kwargs["rotary"] is tables
    for name in (FA4, SDPA):
        attention.run(Decision(name), config, q, k, v, rotary=tables)
        got_q, got_k, kwargs = seen[name]
        assert torch.equal(got_q, rotary_reference(q, *tables)) and torch.equal(got_k, rotary_reference(k, *tables))
        assert "rotary" not in kwargs


@pytest.mark.parametrize("ranking", ["energy", "attention"])
def test_the_policy_builds_the_rotation_inside_the_preparation_before_taking_the_kernel(monkeypatch, ranking):
    """A call that brings tables reaches the policy as ``Call.rotary``, which builds the fused rotation's kernels
    (where the options rotate inside the preparation) before the kernel is chosen: a failed compile falls back."""
    from openvc_diffusers import policy
    from openvc_kernels import ops

    built = []
    monkeypatch.setattr(policy.openvc_kernels, "kernel_unavailable_reason", lambda *args: None)
    monkeypatch.setattr(policy, "build_failure", lambda dtype, **options: built.append(options) or "no ptxas")
    config = openvc_diffusers.load_config({"repair_ranking": ranking, "smooth_k": True})
    options = config.kernel_options_text
    assert policy.kernel_unavailable_reason(torch.device("cuda"), torch.bfloat16, 128, options, True) == "no ptxas"
    assert built[-1]["rotary"] is (ranking == "energy") and built[-1]["smooth_k"]
    policy.kernel_unavailable_reason(torch.device("cuda"), torch.bfloat16, 128, options)
    assert built[-1]["rotary"] is False

    calls = []
    monkeypatch.setattr(backend, "decide", lambda config, call: calls.append(call) or Decision(SDPA))
    monkeypatch.setattr(backend, "run", lambda decision, config, q, *args, **kwargs: q)
    route = backend.Route(own_config=config)
    q, k, v = (torch.randn(1, 16, 2, 128) for _ in range(3))
    backend.attend(route, q, k, v, rotary=_tables(_angles(16)))
    backend.attend(route, q, k, v)
    assert [call.rotary for call in calls] == [True, False]

    loaded = []
    monkeypatch.setattr(ops._dsl_module("prep_ops"), "load_kernels", lambda *args, **kwargs: None)
    monkeypatch.setattr(ops._dsl_module("prep_ops"), "load_prep", lambda kind, dtype=None: loaded.append(kind))
    monkeypatch.setattr(ops, "_kernel", lambda config: None)
    ops.build_failure.cache_clear()
    try:
        for smooth_k in (False, True):
            failure = ops.build_failure(torch.bfloat16, plain_order=False, smooth_k=smooth_k, repair=False, rotary=True)
            assert failure is None
    finally:
        ops.build_failure.cache_clear()
    fused = ["rotary_quantize_qk", "rotary_quantize_qk_centered", "absmax_and_rotated_channel_sums"]
    assert [kind for kind in loaded if "rota" in kind] == fused


def test_rotate_qk_rotates_with_the_reference_where_the_kernel_fails_to_compile(fresh_seed, monkeypatch, caplog):
    def broken(dtype):
        raise rotary.KernelUnavailableError("openvc: the FP8 kernel rotary_qk failed to compile: ptxas fatal")

    monkeypatch.setattr(rotary, "kernel_unavailable_reason", lambda *args: None)
    monkeypatch.setattr(rotary, "load_rotary", broken)
    rotary.rotary_build_failure.cache_clear()
    q, k = torch.randn(2, 1, 10, 2, 128, dtype=torch.bfloat16)
    cos, sin = _tables(_angles(10))
    try:
        with caplog.at_level(logging.WARNING, logger="openvc_kernels"):
            for _ in range(2):
                out_q, out_k = rotate_qk(q, k, cos, sin)
    finally:
        rotary.rotary_build_failure.cache_clear()
    assert torch.equal(out_q, rotary_reference(q, cos, sin)) and torch.equal(out_k, rotary_reference(k, cos, sin))
    assert [r.getMessage() for r in caplog.records] == [
        "openvc: the rotary embedding runs its PyTorch reference: openvc: the FP8 kernel rotary_qk failed to compile: "
        "ptxas fatal"
    ]


@pytest.mark.parametrize("where", ["trimmed to valid keys", "cross-attention"])
def test_calls_the_kernel_sees_only_in_part_are_rotated_before_the_policy(monkeypatch, where):
    """``backend.attend`` rotates first where the kernel would not get the whole sequence the tables are of (keys
    trimmed to a valid prefix, a context-parallel exchange) or the call is cross-attention: ``run`` then gets no
    tables."""
    q, k, v = (torch.randn(1, 16, 2, 128) for _ in range(3))
    tables = _tables(_angles(16))
    runs = []
    monkeypatch.setattr(backend, "run", lambda decision, config, q, k, v, **kwargs: runs.append((q, k, kwargs)) or q)
    route = backend.Route(own_config=openvc_diffusers.load_config({"min_tokens": 0}))
    options = {"valid_len": 16} if where == "trimmed to valid keys" else {}
    route.is_cross = where == "cross-attention"
    backend.attend(route, q, k, v, rotary=tables, **options)
    got_q, got_k, kwargs = runs[0]
    assert torch.equal(got_q, rotary_reference(q, *tables)) and torch.equal(got_k, rotary_reference(k, *tables))
    assert kwargs.get("rotary") is None


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("groups", [1, 2, 5])
@pytest.mark.parametrize("centered", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("batch,seq_len,heads", [(1, 32760, 12), (2, 1000, 3), (1, 127, 1)])
def test_rotation_inside_the_quantization_writes_the_bits_of_rotating_first(
    fresh_seed, batch, seq_len, heads, dtype, centered, groups
):
    """``RotaryQuantizeQK`` into poisoned buffers: every byte of Q's and K's FP8 blocks (padding included) and every
    descale as the reference quantizes ``rotary_reference``'s Q and K (K minus a given channel mean where
    centered), whatever the CTAs that share a block's heads (G = 5 leaves some with fewer, or none); q and k views
    with strides of their own, the tables a view into a longer sequence's."""
    from openvc_kernels import prep_ops
    from openvc_kernels.preparation import PrepareOptions, prepare_reference

    both = torch.randn(batch, seq_len, 2, heads, 128, device="cuda").to(dtype)
    q, k = both[:, :, 0], both[:, :, 1]
    v = torch.randn_like(q)
    cos, sin = (t[:, 5 : 5 + seq_len] for t in _tables(_angles(seq_len + 9, device="cuda")))
    mean = torch.randn(batch, heads, 128, device="cuda") if centered else None
    ref = prepare_reference(
        rotary_reference(q, cos, sin), rotary_reference(k, cos, sin), v, PrepareOptions(smooth_k=centered),
        k_mean=mean,
    )
    q8, k8 = (torch.full_like(ref.q8, 0x7F) for _ in range(2))
    d_q, d_k = (torch.full_like(ref.d_q, float("nan")) for _ in range(2))
    launch = prep_ops.load_prep(prep_ops.rotary_quantize_kind(centered), dtype)
    launch(q, k, rotary.kernel_table(cos), rotary.kernel_table(sin), q8, d_q, k8, d_k, mean, groups)
    for name, got, want in (("q8", q8, ref.q8), ("d_q", d_q, ref.d_q), ("k8", k8, ref.k8), ("d_k", d_k, ref.d_k)):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (name, fresh_seed)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("seq_len", [1, 129, 4100, 32_760])
def test_rotated_keys_block_sums_are_those_of_the_rotated_keys(fresh_seed, dtype, seq_len):
    """``AbsmaxAndRotatedChannelSums`` into poisoned sums: ``quant.channel_block_sums`` of ``rotary_reference``'s K
    (every 8th key, the reference's summation order) bit for bit, and V's absmax."""
    from openvc_kernels import prep_ops
    from openvc_kernels.quant import channel_block_sums, num_blocks

    batch, heads = 2, 3
    offsets = 40 * torch.randn(heads, 128, device="cuda")  # channel offsets: the summation order shows
    k = (torch.randn(batch, seq_len, heads, 128, device="cuda") + offsets).to(dtype)
    v = torch.randn(batch, seq_len, heads, 128, device="cuda").to(dtype)
    cos, sin = _tables(_angles(seq_len, device="cuda"))
    sums = torch.full((batch, heads, num_blocks(seq_len), 128), float("nan"), device="cuda")
    amax = torch.zeros(batch, heads, device="cuda")
    launch = prep_ops.load_prep("absmax_and_rotated_channel_sums", dtype)
    launch(v, k, amax, sums, rotary.kernel_table(cos), rotary.kernel_table(sin))
    assert torch.equal(sums, channel_block_sums(rotary_reference(k, cos, sin))), fresh_seed
    assert torch.equal(amax, v.float().abs().amax(dim=(1, 3)))


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("options", ["API", "smooth_k", "defaults"])
@pytest.mark.parametrize("batch,seq_len,heads", [(1, 32760, 12), (2, 1000, 3), (1, 75600, 2)])
def test_prepare_rotating_inside_writes_the_bytes_of_rotating_first(
    fresh_seed, monkeypatch, batch, seq_len, heads, options
):
    """``prep_ops.prepare(rotary=...)`` into poisoned buffers: every byte and descale of ``prepare`` on
    ``rotate_qk``'s outputs, repair keys included (both choose them from the same energies)."""
    from openvc_kernels import prep_ops
    from openvc_kernels.preparation import PrepareOptions

    options = {
        "API": PrepareOptions(),
        "smooth_k": PrepareOptions(smooth_k=True),
        "defaults": PrepareOptions(smooth_k=True, repair_ratio=0.005),
    }[options]
    q, k, v = (torch.randn(batch, seq_len, heads, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    k += 3 * torch.randn(128, device="cuda", dtype=torch.bfloat16)  # channel offsets, what smoothing removes
    tables = _tables(_angles(seq_len, device="cuda"))
    empty = _PoisonedPrepared(prep_ops.empty_prepared)
    monkeypatch.setattr(prep_ops, "empty_prepared", empty)
    inside = prep_ops.prepare(q, k, v, options, rotary=tables)
    first = prep_ops.prepare(*rotate_qk(q, k, *tables), v, options)
    assert empty.calls == 2
    for name, got, want in zip(inside._fields[:-1], inside[:-1], first[:-1]):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (name, fresh_seed)


class _PoisonedPrepared:
    """``prep_ops.empty_prepared`` whose buffers come poisoned (``poisoned_prepared``), counted."""

    def __init__(self, empty):
        self.empty, self.calls = empty, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return poisoned_prepared(self.empty(*args, **kwargs))


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("return_lse", [False, True])
def test_attention_with_rotary_is_the_call_on_rotated_inputs(fresh_seed, return_lse):
    """``openvc_kernels.attention(rotary=...)`` with the processor's defaults: the output (and lse) of the call on
    ``rotate_qk``'s q and k, bit for bit, rotated inside the preparation or (for the lse) first."""
    import openvc_kernels

    q, k, v = (torch.randn(1, 32760, 12, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    tables = _tables(_angles(32760, device="cuda"))
    options = dict(smooth_k=True, repair_ratio=0.005, return_lse=return_lse)
    inside = openvc_kernels.attention(q, k, v, rotary=tables, **options)
    first = openvc_kernels.attention(*rotate_qk(q, k, *tables), v, **options)
    for got, want in zip(inside, first) if return_lse else [(inside, first)]:
        assert torch.equal(got, want), fresh_seed
