"""What every Open-VC processor shares: the config, the per-module routes that the "openvc" backend follows, and the
bookkeeping (``calls``, layer numbers, the denoising step). Where a family's stock processor dispatches, its Open-VC
processor is that processor with a route in flight around each call (``_routed``); the other families' processors
mirror diffusers' and hand every attention call to ``_attend``. Either way the call ends in ``backend.attend``."""

import weakref
from collections import Counter

import torch
from ..attention import warn_once
from ..backend import IN_FLIGHT, OPENVC, Route, attend
from ..config import format_indices, load_config

ROUTE_ATTR = "_openvc_route"
"""The attention module's attribute that holds its route."""


def eager_inference() -> bool:
    """Neither autograd nor torch.compile: where the rotary launch (``openvc_kernels.rotary.rotate_qk``) may stand in
    for diffusers' rotary code. The launch has no backward; compiled, inductor fuses diffusers' code."""
    return not torch.is_grad_enabled() and not torch.compiler.is_compiling()


def _qkv(attn, x: torch.Tensor, projections, norm_q, norm_k) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    query, key, value = (proj(x).unflatten(2, (attn.heads, -1)) for proj in projections)
    if norm_q is not None:
        query = norm_q(query)
    if norm_k is not None:
        key = norm_k(key)
    return query, key, value


def video_qkv(attn: torch.nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The video stream's query, key and value in joint-attention models (HunyuanVideo, Mochi), as their stock
    processors compute them: projections, heads split, ``norm_q`` / ``norm_k`` where the module has them."""
    return _qkv(attn, hidden_states, (attn.to_q, attn.to_k, attn.to_v), attn.norm_q, attn.norm_k)


def context_qkv(attn: torch.nn.Module, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The text stream's query, key and value: added projections, heads split, ``norm_added_q`` / ``norm_added_k``."""
    return _qkv(
        attn, context, (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj), attn.norm_added_q, attn.norm_added_k
    )


# Every live processor: the hook below covers those installed after apply's, such as pipelines.install's.
_PROCESSORS: weakref.WeakSet["OpenVCProcessorBase"] = weakref.WeakSet()


@torch.compiler.disable
def count_compiled_calls(*hook_args) -> None:
    """Forward pre-hook (``apply`` installs it): add the calls of the compiled forwards since the last one to each
    processor's ``calls``, so that every compiled forward starts with none pending; and check ``bf16_layers``
    against the numbered layers."""
    for processor in _PROCESSORS:
        processor._count_compiled_calls()
        processor.check_bf16_layers()  # apply numbered the layers before any forward


def check_serves(processor: "OpenVCProcessorBase", attn: torch.nn.Module) -> None:
    """Raise ``TypeError`` where ``attn``'s class names its stock processor (diffusers' ``_default_processor_cls``)
    and ``processor`` mirrors none of that name: the stock code it runs would fail on the module's attributes, or
    compute something else. By name: diffusers' copies of a processor in other models (ChronoEdit's
    ``WanAttnProcessor``) compute the same."""
    stock = getattr(type(attn), "_default_processor_cls", None)
    if stock is not None and stock.__name__ not in {c.__name__ for c in processor.stock_processors}:
        mirrors = ", ".join(c.__name__ for c in processor.stock_processors)
        raise TypeError(
            f"{type(processor).__name__} mirrors {mirrors}, but {type(attn).__name__} runs "
            f"{stock.__module__}.{stock.__name__}: install the Open-VC processor of its family, or let "
            "openvc_diffusers.apply(pipe) pick it"
        )


class OpenVCProcessorBase:
    """Base of the family processors; ``config`` is anything ``openvc_diffusers.load_config`` takes.

    Self-attention layers (joint video+text attention included) are numbered for ``bf16_layers`` in module order by
    ``openvc_diffusers.apply``, else in the order they first run; the denoising step, for ``bf16_steps``, comes from
    the ``step_tracker`` that ``apply`` installs. ``calls`` counts the calls per ``(kind, backend)``, kind being
    "self" or "cross": under torch.compile too when ``apply`` installed the processor, while a CUDA graph's replays
    add nothing (its calls are counted once, at capture).
    """

    # Set by openvc_diffusers.apply when a parallel degree is above 1 or the model is sharded already, or by
    # diffusers' enable_parallelism.
    _parallel_config = None
    stock_processors: tuple[type, ...] = ()
    """diffusers' processors this one mirrors and replaces (``apply`` installs it where it finds them)."""

    def __init__(self, config=None):
        self.config = load_config(config)
        self.step_tracker = None
        self.fallback_backend = None
        """The diffusers backend of the policy's ``sdpa``: ``set_attention_backend``'s choice; None: the active one."""
        self.layer_count = 0
        self._calls: Counter[tuple[str, str]] = Counter()
        self._routes: list[Route] = []
        self._bf16_layers_checked = False
        _PROCESSORS.add(self)

    # The stock processor code that ours runs passes this to diffusers' dispatch: always "openvc". diffusers'
    # set_attention_backend and reset_attention_backend write it on every processor; route() takes what they wrote as
    # the backend of the policy's sdpa fallback and puts "openvc" back.
    _attention_backend = OPENVC

    @property
    def calls(self) -> Counter[tuple[str, str]]:
        """Calls per ``(kind, backend)``; those of compiled forwards are added when this is read."""
        self._count_compiled_calls()
        return self._calls

    @property
    def step(self) -> int | None:
        return None if self.step_tracker is None else self.step_tracker.step

    def _count_compiled_calls(self) -> None:
        for route in self._routes:
            if route.compiled_calls:
                self._calls.update(route.compiled_calls)
                route.compiled_calls.clear()

    def route(self, attn: torch.nn.Module, *, is_cross: bool) -> Route:
        """``attn``'s route, made at its first call unless ``apply`` made it up front. A compiled model should not
        make one: traced, the layer count is a guard that every later block fails."""
        if self._attention_backend != OPENVC:
            self.fallback_backend, self._attention_backend = self._attention_backend, OPENVC
        route = getattr(attn, ROUTE_ATTR, None)
        if route is not None and route.owner is self:
            # A numbered layer called again, not the backend looking up the route in flight: all are numbered.
            if not torch.compiler.is_compiling() and route is not IN_FLIGHT.route:
                self.check_bf16_layers()
            return route
        check_serves(self, attn)
        index = None if is_cross else self.layer_count
        self.layer_count += not is_cross
        route = Route(
            is_cross=is_cross,
            index=index,
            layer=index if index in self.config.bf16_layers else None,
            owner=self,
            attn=attn,
            calls=self._calls,
            # Compiled calls are counted only where apply's pre-hook empties the counts before every forward.
            compiled_calls={} if self.step_tracker is not None else None,
        )
        self._routes.append(route)
        setattr(attn, ROUTE_ATTR, route)
        return route

    def _layer(self, attn: torch.nn.Module) -> int:
        """The number of ``attn``'s self-attention layer."""
        return self.route(attn, is_cross=False).index

    def _routed(
        self,
        attn: torch.nn.Module,
        is_cross: bool,
        stock_call,
        *args,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``stock_call(self, attn, *args)`` (a stock processor's ``__call__``, which dispatches to the "openvc"
        backend) with ``attn``'s route in flight, so that the backend calls ``_attend`` with it; ``rotary``, the
        (cos, sin) tables taken out of ``args``, for the backend to apply to the query and key it receives."""
        previous = IN_FLIGHT.route, IN_FLIGHT.rotary
        IN_FLIGHT.route, IN_FLIGHT.rotary = self.route(attn, is_cross=is_cross), rotary
        try:
            return stock_call(self, attn, *args)
        finally:
            IN_FLIGHT.route, IN_FLIGHT.rotary = previous

    def check_bf16_layers(self) -> None:
        """Once the layers are numbered, warn (once) about ``bf16_layers`` past the model's last layer: entries
        that match no call, most likely written for another model."""
        if self._bf16_layers_checked or not self.layer_count:
            return
        self._bf16_layers_checked = True
        count = self.layer_count
        past = [layer for layer in self.config.bf16_layers if layer >= count]
        if past:
            warn_once(
                f"Open-VC: bf16_layers {format_indices(past)} are past this model's {count} self-attention layers "
                f"(0-{count - 1}); those entries match no call"
            )

    def _check_step_tracking(self) -> None:
        if self.config.bf16_steps and self.step_tracker is None:
            raise RuntimeError(
                f"bf16_steps [{format_indices(self.config.bf16_steps)}] needs denoising-step tracking, which "
                "openvc_diffusers.apply(pipe, config) installs; this processor was installed without it "
                "(set_attn_processor alone), so it cannot tell the steps apart"
            )

    def _attend(
        self, attn: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_cross: bool, **options
    ) -> torch.Tensor:
        """Attention on ``(B, S, H, D)`` through the backend the policy picks; ``(B, S_q, H * D)`` out. ``options``
        are ``backend.attend``'s: ``attn_mask``, ``valid_len``, ``pad_queries``, ``rotary`` (the tables of a
        rotary embedding that q and k have not had yet, which the backend took from the stock code), and
        ``parallel_config``: the one diffusers' stock code passed with the call (None for cross-attention to a
        context it leaves whole), else this processor's."""
        self._check_step_tracking()
        route = self.route(attn, is_cross=is_cross)
        options.setdefault("parallel_config", self._parallel_config)
        out = attend(route, q, k, v, **options)
        return out.flatten(2, 3).type_as(q)
