"""The rotary embedding Open-VC's Wan processor hands to the backend (``openvc_kernels.rotary``): the reference is
diffusers' arithmetic bit for bit, the processor's output is the same with it as with diffusers' code, the kernel
compiles for sm_90a with the reference's roundings (CPU), and on a Hopper GPU writes the reference's bits, also on
HunyuanVideo's tables, where it stands in for diffusers' ``apply_rotary_emb`` (``processors/hunyuan.py``)."""

import collections
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoRotaryPosEmbed
from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

import openvc_diffusers
from openvc_diffusers import backend
from openvc_diffusers.processors import hunyuan, wan
from openvc_diffusers.tiny import cast_like_from_pretrained, tiny_wan_inputs, tiny_wan_transformer
from openvc_kernels import rotary
from openvc_kernels.rotary import kernel_rotary_reason, rotary_reference, rotate_qk

needs_hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0), reason="needs a Hopper GPU"
)


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
    it does rotate them (once per self-attention call)."""
    model = cast_like_from_pretrained(tiny_wan_transformer(seed=fresh_seed), dtype)
    openvc_diffusers.apply(model, {"min_tokens": 0})
    inputs = tiny_wan_inputs()
    for name in ("hidden_states", "encoder_hidden_states"):
        inputs[name] = torch.randn_like(inputs[name]).to(dtype)
    rotated = []
    monkeypatch.setattr(backend, "rotate_qk", lambda *args: rotated.append(args[0].shape) or rotate_qk(*args))
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
    """``RotaryQK`` compiled for sm_90a in a fresh process (no GPU needed): its PTX opcode counts per dtype."""
    dump = tmp_path_factory.mktemp("rotary_ptx")
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=str(dump))
    done = subprocess.run([sys.executable, "-c", _PTX_SCRIPT], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


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
