"""The diffusers attention backend "openvc" on tiny random models: registered under diffusers' own names, routed by
the policy, bit for bit our processor's output where both routes take the same path, and within the FP8 tolerance of
diffusers' SDPA elsewhere."""

import importlib
import logging
import math
from types import SimpleNamespace

import pytest
import torch
from openvc_diffusers.metrics import rel_l2
from diffusers import FluxTransformer2DModel
from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry, attention_backend
from test_families import build, forward

import openvc_diffusers
from openvc_diffusers import backend

pytestmark = [
    pytest.mark.usefixtures("one_thread", "own_log"),
    # Mochi's RoPE asks for float32 autocast, which the CPU does not have; it runs in float32 regardless.
    pytest.mark.filterwarnings("ignore:In CPU autocast:UserWarning"),
]

# The module, not the attention() function that the package exports under the same name.
attention_module = importlib.import_module("openvc_diffusers.attention")

SELF, CROSS, OPENVC, SDPA = "self", "cross", "openvc-reference", "sdpa"


@pytest.fixture
def own_log(monkeypatch):
    """Reasons logged here are logged again by later tests (the log says each once per process)."""
    monkeypatch.setattr(attention_module, "_said", set())


@pytest.fixture
def registered():
    """``register(config)`` for the test, the import's registration (defaults, $OPENVC_CONFIG unset) after it; the
    backend's counts start empty."""

    def with_config(config):
        openvc_diffusers.register(config)
        return backend.calls()

    yield with_config
    openvc_diffusers.register()


@pytest.fixture
def stock_afterwards():
    """diffusers 0.42's set_attention_backend also makes its backend the process-wide one (diffusers#14249), which
    reset_attention_backend leaves: attention_backend() puts the native one back when the test is done."""
    with attention_backend("native"):
        yield


def flux():
    torch.manual_seed(0)
    model = FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=128, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=16, axes_dims_rope=(16, 56, 56),
    )  # fmt: skip
    # 12 x 12 image tokens after 8 text tokens; ids are (0, row, column) as the Flux pipeline makes them.
    rows, cols = torch.meshgrid(torch.arange(12), torch.arange(12), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).flatten(0, 1).float()
    inputs = dict(hidden_states=torch.randn(1, 144, 4), encoder_hidden_states=torch.randn(1, 8, 32),
                  pooled_projections=torch.randn(1, 16), timestep=torch.tensor([0.5]), img_ids=img_ids,
                  txt_ids=torch.zeros(8, 3))  # fmt: skip
    return model.eval(), inputs


def test_openvc_is_a_diffusers_backend_name():
    assert AttentionBackendName("openvc") is AttentionBackendName.OPENVC is backend.OPENVC
    assert "openvc" in {member.value for member in AttentionBackendName.__members__.values()}
    assert AttentionBackendName.OPENVC in list(AttentionBackendName)
    assert _AttentionBackendRegistry._backends[backend.OPENVC] is backend.openvc_attention
    assert _AttentionBackendRegistry._is_context_parallel_available(backend.OPENVC)


@pytest.mark.parametrize("version", ["0.36.0", "0.43.0", "0.43.0.dev0", "1.0.0"])
def test_untested_diffusers_versions_are_refused(version):
    with pytest.raises(RuntimeError, match=rf"diffusers>=0\.37,<0\.43; diffusers {version} is installed"):
        backend.check_diffusers_version(version)


@pytest.mark.parametrize("version", ["0.37.0", "0.42.1"])
def test_tested_diffusers_versions_are_taken(version):
    backend.check_diffusers_version(version)


@pytest.mark.parametrize("name", ["wan", "ltx"])
def test_backend_is_our_processor_bit_for_bit(name, registered, stock_afterwards):
    config = {"min_tokens": 0}
    model, inputs = build(name)
    stock = forward(model, inputs)
    calls = registered(config)
    model.set_attention_backend("openvc")
    through_backend = forward(model, inputs)
    assert calls == {(SELF, OPENVC): 2, (CROSS, SDPA): 2}
    model.reset_attention_backend()
    processor = openvc_diffusers.apply(model, config)
    assert torch.equal(forward(model, inputs), through_backend)
    assert processor.calls == {(SELF, OPENVC): 2, (CROSS, SDPA): 2}
    assert 0 < rel_l2(through_backend, stock) < 0.05


# What set_attention_backend("openvc") alone does to each family's attention, with {"min_tokens": 0} (README's
# table): the calls the backend routed. Where Open-VC took some, the output is within the FP8 tolerance of stock's;
# elsewhere it is stock's, bit for bit.
BACKEND_ROUTE = {
    "wan": {(SELF, OPENVC): 2, (CROSS, SDPA): 2},
    "skyreels": {(SELF, OPENVC): 2, (CROSS, SDPA): 2},
    "ltx": {(SELF, OPENVC): 2, (CROSS, SDPA): 2},
    # Joint attention with a text-padding mask: the stock processors hand the backend a mask, which Open-VC does not
    # take (our processors trim the sequence to the valid prefix instead, tests/test_families.py).
    "hunyuan_video": {(SELF, SDPA): 2},
    "hunyuan_video15": {(SELF, SDPA): 2},
    # Their stock processors call SDPA themselves and never reach a backend.
    "cogvideox": {},
    "mochi": {},
    "flux": {(SELF, OPENVC): 2},  # one dual-stream block, one single-stream block
}


@pytest.mark.parametrize("name", BACKEND_ROUTE)
def test_what_the_backend_alone_covers(name, registered, stock_afterwards):
    model, inputs = flux() if name == "flux" else build(name)
    stock = forward(model, inputs)
    calls = registered({"min_tokens": 0})
    model.set_attention_backend("openvc")
    ours = forward(model, inputs)
    assert calls == BACKEND_ROUTE[name]
    if (SELF, OPENVC) in calls:
        assert 0 < rel_l2(ours, stock) < 0.05
    else:
        assert torch.equal(ours, stock)


def test_context_manager_is_set_attention_backend(registered, stock_afterwards):
    model, inputs = build("wan")
    registered({"min_tokens": 0})
    with attention_backend("openvc"):
        in_context = forward(model, inputs)
    model.set_attention_backend("openvc")
    assert torch.equal(forward(model, inputs), in_context)


def test_reset_attention_backend_restores_stock(registered):
    model, inputs = build("wan")
    stock = forward(model, inputs)
    registered({"min_tokens": 0})
    with attention_backend("native"):  # see stock_afterwards
        model.set_attention_backend("openvc")
        assert not torch.equal(forward(model, inputs), stock)
        model.reset_attention_backend()
    assert torch.equal(forward(model, inputs), stock)


def test_register_names_the_config_and_defaults_to_openvc_config(registered, stock_afterwards, tmp_path, monkeypatch):
    model, inputs = build("wan")
    stock = forward(model, inputs)
    model.set_attention_backend("openvc")
    calls = registered({"backends": ["sdpa"]})
    assert torch.equal(forward(model, inputs), stock)
    assert calls == {(SELF, SDPA): 2, (CROSS, SDPA): 2}
    (tmp_path / "openvc.yaml").write_text("min_tokens: 0\n")
    monkeypatch.setenv("OPENVC_CONFIG", str(tmp_path / "openvc.yaml"))
    calls = registered(None)
    forward(model, inputs)
    assert calls == {(SELF, OPENVC): 2, (CROSS, SDPA): 2}


def test_bf16_layers_without_layer_numbers_are_named_once(registered, stock_afterwards, caplog):
    model, inputs = build("wan")
    calls = registered({"min_tokens": 0, "bf16_layers": [1]})
    model.set_attention_backend("openvc")
    with caplog.at_level(logging.WARNING, logger="openvc_diffusers"):
        forward(model, inputs)
        forward(model, inputs)
    assert calls == {(SELF, OPENVC): 4, (CROSS, SDPA): 4}
    assert sum("openvc_diffusers.apply" in r.getMessage() for r in caplog.records) == 1


def test_bf16_steps_without_step_tracking_are_refused(registered, stock_afterwards):
    model, inputs = build("wan")
    registered({"min_tokens": 0, "bf16_steps": [0]})
    model.set_attention_backend("openvc")
    with pytest.raises(RuntimeError, match=r"bf16_steps \[0\] needs denoising-step tracking.*backend alone"):
        forward(model, inputs)


def test_bf16_layers_through_apply(stock_afterwards):
    model, inputs = build("wan")
    processor = openvc_diffusers.apply(model, {"min_tokens": 0, "bf16_layers": [1]})
    forward(model, inputs)
    assert processor.calls == {(SELF, OPENVC): 1, (SELF, SDPA): 1, (CROSS, SDPA): 2}


def test_set_attention_backend_on_our_processor_picks_the_fallback(stock_afterwards):
    # With backends [sdpa] every call is the fallback: diffusers' math backend instead of its default one.
    model, inputs = build("wan")
    openvc_diffusers.apply(model, {"backends": ["sdpa"]})
    model.set_attention_backend("_native_math")
    with attention_backend("_native_math"):
        stock_math = forward(build("wan")[0], inputs)
    assert torch.equal(forward(model, inputs), stock_math)


def test_other_attention_arguments_go_to_native_attention(registered):
    """Causal attention, grouped-query attention (fewer key heads) and another scale: diffusers' native attention,
    bit for bit, counted as the policy's sdpa."""
    q, k, v = (torch.randn(1, 256, 2, 128) for _ in range(3))
    registered({"min_tokens": 0})
    sdpa = lambda q, k, v, **options: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
        *(x.transpose(1, 2) for x in (q, k, v)), **options
    ).transpose(1, 2)
    causal = backend.openvc_attention(q, k, v, is_causal=True)
    assert torch.equal(causal, sdpa(q, k, v, is_causal=True))
    grouped = backend.openvc_attention(q, k[:, :, :1], v[:, :, :1], enable_gqa=True)
    assert torch.equal(grouped, sdpa(q, k[:, :, :1], v[:, :, :1], enable_gqa=True))
    assert torch.equal(backend.openvc_attention(q, k, v, scale=0.1), sdpa(q, k, v, scale=0.1))
    assert backend.calls() == {(SELF, SDPA): 3}


def test_the_default_scale_however_spelled_takes_open_vc(registered):
    q, k, v = (torch.randn(1, 256, 2, 128) for _ in range(3))
    calls = registered({"min_tokens": 0})
    spellings = (None, 128**-0.5, 1 / math.sqrt(128))
    assert 128**-0.5 != 1 / math.sqrt(128)  # the last bit: both must count
    for scale in spellings:
        backend.openvc_attention(q, k, v, scale=scale)
    assert calls == {(SELF, OPENVC): len(spellings)}
    # The BF16 fallbacks take no scale: one held in float32, however close, must reach an attention that uses it.
    for scale in (0.1, torch.tensor(128**-0.5, dtype=torch.float32).item(), 64**-0.5, 0.0):
        assert not backend.is_default_scale(scale, 128), scale


def test_a_fallback_call_keeps_its_context_parallel_config(registered, monkeypatch):
    """Under context parallelism a call that goes to native attention still attends across the ranks."""
    passed = {}
    monkeypatch.setattr(backend, "dispatch_attention_fn", lambda *args, **kwargs: passed.update(kwargs))
    registered({"min_tokens": 0})
    q, k, v = (torch.randn(1, 256, 2, 128) for _ in range(3))
    sharding = object()
    backend.openvc_attention(q, k, v, dropout_p=0.1, _parallel_config=sharding)
    assert passed == {"backend": AttentionBackendName.NATIVE, "parallel_config": sharding}


def test_parallel_degrees_take_effect_only_through_apply(registered, stock_afterwards):
    """A config's parallel degrees with the backend alone, or with a processor installed without ``apply``, would
    run every rank on the whole sequence: refused at the first call, as is a sharding other than the config's."""
    model, inputs = build("wan")
    registered({"parallel": {"ulysses_degree": 2}})
    # Cross-attention: diffusers passes no parallel config where it leaves the context whole (Wan): not refused.
    q, context = torch.randn(1, 256, 2, 128), torch.randn(1, 16, 2, 128)
    backend.openvc_attention(q, context, context)
    model.set_attention_backend("openvc")
    with pytest.raises(RuntimeError, match=r"parallel.ulysses_degree 2 shards the model only through "
                       r"openvc_diffusers.apply\(pipe, config\), but this call runs under context parallelism none"):
        forward(model, inputs)
    model.set_attn_processor(openvc_diffusers.OpenVCProcessor({"parallel": {"ring_degree": 2}}))
    with pytest.raises(RuntimeError, match=r"parallel.ring_degree 2 shards the model only through"):
        forward(model, inputs)
    config = openvc_diffusers.OpenVCConfig(ulysses_degree=2)
    sharded = lambda ulysses, ring: SimpleNamespace(  # noqa: E731
        context_parallel_config=SimpleNamespace(ulysses_degree=ulysses, ring_degree=ring)
    )
    backend.check_sharding(config, sharded(2, 1))
    backend.check_sharding(openvc_diffusers.OpenVCConfig(), sharded(4, 2))  # diffusers' enable_parallelism alone
    with pytest.raises(RuntimeError, match=r"parallel.ulysses_degree 2 .* context parallelism "
                       r"parallel.ulysses_degree 2 x parallel.ring_degree 2: call apply"):
        backend.check_sharding(config, sharded(2, 2))
