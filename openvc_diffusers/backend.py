"""The diffusers attention backend "openvc": after ``import openvc_diffusers``,
``model.set_attention_backend("openvc")`` or ``with attention_backend("openvc"):`` sends a model's attention through
the Open-VC policy.

diffusers names its backends in a closed str Enum (``AttentionBackendName``) and looks every name up in it, so this
module's import adds the member ``OPENVC = "openvc"`` with aenum's ``extend_enum`` (written by the author of the stdlib
enum, it follows the enum internals of each Python release), and ``register`` records ``openvc_attention`` in
diffusers' registry. Both are private diffusers API, hence the version check before either.

Each call is routed by a ``Route``: the one an Open-VC processor puts in flight around its stock processor's call
(its config, the layer, the step, whether it is cross-attention, where to count it), else the backend's own (the
registered config; cross-attention where the key sequence is not as long as the query's; no layer or step).
"""

import functools
import math
from collections import Counter
from dataclasses import dataclass, field

import diffusers
import torch
import torch.nn.functional as F
from aenum import extend_enum
from diffusers.models.attention_dispatch import (
    AttentionBackendName,
    _AttentionBackendRegistry,
    _check_device,
    _check_shape,
    dispatch_attention_fn,
)
from packaging.version import Version

from openvc_kernels.rotary import rotate_qk

from .attention import OPENVC_BACKENDS, run, run_openvc, warn_once
from .config import OPENVC, SDPA, OpenVCConfig, format_indices, load_config
from .parallel import describe_degrees, sharded_attention
from .policy import Call, decide
from .ring import gather_sequence, ring_attention

NAME = OPENVC
"""The backend's name in diffusers: the policy's name for Open-VC."""
TESTED_DIFFUSERS = ((0, 37), (0, 43))
"""diffusers releases the package was tested on: from the first (inclusive) to the second (exclusive). The registry's
``supports_context_parallel`` dates from 0.36; 0.37 is the first whose Wan context-parallel plan leaves the text
context whole on every rank, which Ulysses here relies on (cross-attention takes no all-to-all)."""


def check_diffusers_version(version: str = diffusers.__version__) -> None:
    """Raise ``RuntimeError`` unless ``version`` is a diffusers release the backend was tested on."""
    (low, high), release = TESTED_DIFFUSERS, Version(version).release
    if not low <= release[:2] < high:
        tested = f">={low[0]}.{low[1]},<{high[0]}.{high[1]}"
        raise RuntimeError(
            f"openvc_diffusers registers its attention backend through diffusers' private registry and was tested "
            f"on diffusers{tested}; diffusers {version} is installed: pip install 'diffusers{tested}'"
        )


check_diffusers_version()
if NAME not in AttentionBackendName._value2member_map_:
    extend_enum(AttentionBackendName, "OPENVC", NAME)
OPENVC = AttentionBackendName.OPENVC


@dataclass(eq=False)
class Route:
    """What the backend knows of an attention call besides its tensors: the backend's own, or that of one attention
    module under an Open-VC processor (``owner``), which keeps it on the module.

    ``layer`` is what the policy reads: the layer number where it is one of ``bf16_layers``, else None, so that
    torch.compile's guard on it holds from block to block (``index`` is the number itself). ``is_cross`` None:
    cross-attention where the keys are not as many as the queries.
    """

    own_config: OpenVCConfig | None = None
    """The backend's config; an owner's routes follow the owner's ``config`` (examples/calibrate.py swaps it)."""
    is_cross: bool | None = None
    index: int | None = None
    layer: int | None = None
    owner: object = None
    attn: torch.nn.Module | None = None
    calls: Counter = field(default_factory=Counter)
    compiled_calls: dict | None = None
    """Where compiled calls are counted, None to leave them uncounted; the owner empties it before each forward,
    so that torch.compile's guard on it (empty) holds in every block of a model and at every step."""

    @property
    def config(self) -> OpenVCConfig:
        return self.own_config if self.owner is None else self.owner.config

    @property
    def step(self) -> int | None:
        """The step where it is one of ``bf16_steps``, else None (a guard on the step would recompile every step)."""
        tracker = getattr(self.owner, "step_tracker", None)
        return None if tracker is None else tracker.watched_step

    @property
    def fallback(self):
        """The diffusers backend that the policy's ``sdpa`` stands for: the owner's ``set_attention_backend`` choice."""
        return getattr(self.owner, "fallback_backend", None)

    def count(self, kind: str, backend: str) -> None:
        if not torch.compiler.is_compiling():
            self.calls[kind, backend] += 1
        elif self.compiled_calls is not None:
            # Traced, `calls[key] += 1` would be a guard on the count, and a recompile at every call.
            self.compiled_calls[kind, backend] = self.compiled_calls.get((kind, backend), 0) + 1


class _InFlight:
    """The route of the call in flight, set by a processor around its stock processor's call, and the rotary tables
    that the backend applies to its query and key (``rotate_qk``) where the processor took them from the stock code."""

    def __init__(self):
        # Instance attributes from the start: torch.compile guards on where an attribute lives.
        self.route: Route | None = None
        self.rotary: tuple[torch.Tensor, torch.Tensor] | None = None


IN_FLIGHT = _InFlight()
_registered: Route | None = None


def register(config=None) -> None:
    """Register "openvc" in diffusers' backend registry (``import openvc_diffusers`` does, with ``config`` None), its
    calls follow ``config``: anything ``load_config`` takes; None reads ``$OPENVC_CONFIG`` or the defaults.
    Calling it again names another config for the calls that no Open-VC processor routes."""
    global _registered
    _registered = Route(own_config=load_config(config))
    checks = [_check_device, _check_shape]  # diffusers runs them where DIFFUSERS_ATTN_CHECKS is set
    _AttentionBackendRegistry.register(OPENVC, constraints=checks, supports_context_parallel=True)(openvc_attention)


def calls() -> Counter:
    """Calls per ``(kind, backend)`` that the backend routed itself (no Open-VC processor around them), eagerly run."""
    return _registered.calls


def openvc_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    _parallel_config=None,
) -> torch.Tensor:
    """The registered backend: ``(B, S, H, D)`` in and out, as diffusers' backends take them."""
    rotary = IN_FLIGHT.rotary
    route = IN_FLIGHT.route or _registered
    if dropout_p or is_causal or enable_gqa or not is_default_scale(scale, query.shape[-1]):
        if rotary is not None:
            query, key = rotate_qk(query, key, *rotary)
        warn_once(
            f"Open-VC fallback to native: dropout_p={dropout_p}, is_causal={is_causal}, enable_gqa={enable_gqa}, "
            f"scale={scale}; Open-VC takes dropout_p=0, is_causal=False, enable_gqa=False and scale "
            "1/sqrt(head_dim)"
        )
        route.count("cross" if _is_cross(route, query, key) else "self", SDPA)
        return dispatch_attention_fn(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
            backend=AttentionBackendName.NATIVE, parallel_config=_parallel_config,
        )
    if IN_FLIGHT.route is None:
        config = _registered.config
        if config.bf16_steps:
            raise RuntimeError(
                f"bf16_steps [{format_indices(config.bf16_steps)}] needs denoising-step tracking, which "
                'openvc_diffusers.apply(pipe, config) installs; the "openvc" backend alone cannot tell the steps apart'
            )
        if config.bf16_layers:
            warn_once(
                'Open-VC: bf16_layers needs layer numbers, which the "openvc" backend alone does not have: '
                "openvc_diffusers.apply(pipe, config) numbers them (and routes through this backend)"
            )
        return attend(
            _registered, query, key, value, attn_mask=attn_mask, parallel_config=_parallel_config, rotary=rotary
        )
    # An Open-VC processor's call: through its _attend, which subclasses extend (examples/ time and capture there).
    out = route.owner._attend(
        route.attn, query, key, value, is_cross=route.is_cross, attn_mask=attn_mask, parallel_config=_parallel_config,
        rotary=rotary,
    )
    return out.unflatten(2, (query.shape[2], -1))


def is_default_scale(scale: float | None, head_dim: int) -> bool:
    """Whether ``scale`` is the softmax scale every backend of the policy uses, ``1 / sqrt(head_dim)``: None, or
    either float64 spelling of it (``head_dim ** -0.5`` and ``1 / math.sqrt(head_dim)`` differ in the last bit).
    The policy's BF16 fallbacks take no scale, so any other value, however close, goes to native attention."""
    return scale is None or scale == head_dim**-0.5 or scale == 1 / math.sqrt(head_dim)


def _is_cross(route: Route, q: torch.Tensor, k: torch.Tensor) -> bool:
    """The route's own answer, else cross-attention where the keys are not as many as the queries."""
    return route.is_cross if route.is_cross is not None else k.shape[1] != q.shape[1]


def check_sharding(config: OpenVCConfig, parallel_config) -> None:
    """Raise unless a self-attention call runs under the context parallelism ``config``'s parallel degrees ask for
    (``parallel_config``: the call's; diffusers passes none with cross-attention whose context it leaves whole): they
    take effect only through ``openvc_diffusers.apply``, and an Open-VC processor or the backend alone would otherwise
    run every rank on the whole sequence (or on another sharding) without a word."""
    if config.ulysses_degree * config.ring_degree == 1:
        return
    cp = None if parallel_config is None else parallel_config.context_parallel_config
    if cp is None or (cp.ulysses_degree, cp.ring_degree) != (config.ulysses_degree, config.ring_degree):
        in_effect = "none" if cp is None else describe_degrees(cp.ulysses_degree, cp.ring_degree)
        raise RuntimeError(
            f"{describe_degrees(config.ulysses_degree, config.ring_degree)} shards the model only through "
            f"openvc_diffusers.apply(pipe, config), but this call runs under context parallelism {in_effect}: call "
            "apply() with this config, or set the parallel degrees to 1 (the default)"
        )


def attend(
    route: Route,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    parallel_config=None,
    valid_len: int | None = None,
    pad_queries: bool = False,
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention on ``(B, S, H, D)`` through the backend the policy picks, in q's dtype and layout.

    ``rotary``: (cos, sin), a rotary embedding that q and k still need (``rotate_qk``'s tables): applied inside
    the Open-VC kernel's preparation where the call takes the kernel on the whole sequence (``attention.run``),
    else first.

    ``valid_len``: ``attn_mask`` hides exactly the keys from this index on, in every batch row, so a backend that
    takes no mask runs on K/V trimmed to it; SDPA still gets the mask, which keeps its output identical to diffusers'.
    ``pad_queries``: the mask also hides the query rows from ``valid_len`` on, whose output is then zero (as SDPA
    gives a row with no key), so those rows are trimmed too.

    Under context parallelism (``parallel_config`` set, ``parallel.py``) self-attention is exchanged and passed
    around the ranks (``attend_shard``); cross-attention needs neither where diffusers leaves the context whole
    (Wan: it passes no parallel config), and where it shards the context too (LTX's plan splits the prompt and its
    mask: it passes the config), each rank gathers every rank's part of it (``gather_context``).
    """
    is_cross = _is_cross(route, q, k)
    if rotary is not None and (parallel_config is not None or valid_len is not None or is_cross):
        # Exchanged, trimmed or cross-attention: the kernel would not see the whole sequence the tables are of.
        q, k = rotate_qk(q, k, *rotary)
        rotary = None
    if not is_cross:
        check_sharding(route.config, parallel_config)
    if parallel_config is not None and not is_cross:
        if attn_mask is not None:
            raise RuntimeError("Open-VC: masked self-attention under context parallelism is not supported")
        return sharded_attention(q, k, v, parallel_config, functools.partial(attend_shard, route))
    if parallel_config is not None:
        k, v, attn_mask = gather_context(k, v, attn_mask, parallel_config)
    trim = valid_len is not None
    q_seen = q[:, :valid_len] if trim and pad_queries else q
    layer = None if is_cross else route.layer
    has_mask = attn_mask is not None and not trim
    call = Call(
        q_seen, k, v, is_cross=is_cross, has_mask=has_mask, layer=layer, step=route.step, rotary=rotary is not None
    )
    decision = decide(route.config, call)
    route.count("cross" if is_cross else "self", decision.backend)
    if trim and decision.backend != SDPA:
        out = run(decision, route.config, q_seen, k[:, :valid_len], v[:, :valid_len])
        return F.pad(out, (0, 0, 0, 0, 0, q.shape[1] - q_seen.shape[1]))
    return run(
        decision, route.config, q, k, v, attn_mask=attn_mask, attention_backend=route.fallback, rotary=rotary
    )


def gather_context(k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, parallel_config):
    """A cross-attention call's context, sharded along the sequence by diffusers' plan over the whole context-parallel
    mesh (in the flattened mesh's rank order, as its sharder splits it), gathered on every rank: ``(B, T, H, D)``
    k and v, and the mask's last dim (the keys) likewise."""
    group = parallel_config.context_parallel_config._flattened_mesh.get_group()
    k, v = gather_sequence(k, group), gather_sequence(v, group)
    if attn_mask is not None:
        attn_mask = gather_sequence(attn_mask.movedim(-1, 1), group).movedim(1, -1)
    return k, v, attn_mask


def attend_shard(route: Route, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring_group, ring_degree: int):
    """Self-attention on ``(B, S/R, H, D)`` after the Ulysses exchange: this rank's ring shard of the sequence (all of
    it where ``ring_group`` is None). The policy decides on the whole sequence, as one process would; Open-VC runs as
    ring attention, any other backend on the gathered keys and values."""
    call = Call(q, k, v, is_cross=False, layer=route.layer, step=route.step, query_tokens=q.shape[1] * ring_degree)
    decision = decide(route.config, call)
    route.count("self", decision.backend)
    config = route.config
    if ring_group is None:
        return run(decision, config, q, k, v, attention_backend=route.fallback)
    if decision.backend in OPENVC_BACKENDS:
        shard_attention = functools.partial(run_openvc, decision, config)
        return ring_attention(q, k, v, ring_group, shard_attention, smooth_k=config.smooth_k)
    k, v = gather_sequence(k, ring_group), gather_sequence(v, ring_group)
    return run(decision, config, q, k, v, attention_backend=route.fallback)
