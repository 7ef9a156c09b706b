"""What every Open-VC processor shares: the config, the per-call policy decision and run, and the bookkeeping
(``calls``, layer numbers, the denoising step). Each family's processor mirrors diffusers' stock one and hands
every attention call to ``_attend``."""

import weakref
from collections import Counter

import torch
import torch.nn.functional as F

from ..attention import run, warn_once
from ..config import format_indices, load_config
from ..parallel import heads_to_sequence, sequence_to_heads, ulysses_group
from ..policy import SDPA, Call, decide


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
        processor.check_bf16_layers()  # a compiled forward numbers the layers while tracing, out of sight of _layer


class OpenVCProcessorBase:
    """Base of the family processors; ``config`` is anything ``openvc_diffusers.load_config`` takes.

    Self-attention layers (joint video+text attention included) are numbered in the order they first run, for
    ``bf16_layers``; the denoising step, for ``bf16_steps``, comes from the ``step_tracker`` that
    ``openvc_diffusers.apply`` installs. ``calls`` counts the calls per ``(kind, backend)``, kind being "self"
    or "cross": under torch.compile too when ``apply`` installed the processor, while a CUDA graph's replays add
    nothing (its calls are counted once, at capture).
    """

    # Set by diffusers' set_attention_backend, as on its own processors; _parallel_config by
    # openvc_diffusers.apply when parallel.ulysses_degree > 1.
    _attention_backend = None
    _parallel_config = None

    def __init__(self, config=None):
        self.config = load_config(config)
        self.step_tracker = None
        self._layers: weakref.WeakKeyDictionary[torch.nn.Module, int] = weakref.WeakKeyDictionary()
        self._calls: Counter[tuple[str, str]] = Counter()
        self._compiled_calls: dict[tuple[str, str], int] = {}
        self._bf16_layers_checked = False
        _PROCESSORS.add(self)

    @property
    def calls(self) -> Counter[tuple[str, str]]:
        """Calls per ``(kind, backend)``; those of compiled forwards are added when this is read."""
        self._count_compiled_calls()
        return self._calls

    @property
    def step(self) -> int | None:
        return None if self.step_tracker is None else self.step_tracker.step

    def _count(self, kind: str, backend: str) -> None:
        if not torch.compiler.is_compiling():
            self._calls[kind, backend] += 1
        elif self.step_tracker is not None:
            # Traced, `calls[key] += 1` is a guard on the count: a recompile at every call. A compiled forward
            # counts into _compiled_calls, which apply's pre-hook (installed with step_tracker) empties before every
            # forward, so its guard is on an empty dict and holds. Without that hook compiled calls go uncounted.
            self._compiled_calls[kind, backend] = self._compiled_calls.get((kind, backend), 0) + 1

    def _count_compiled_calls(self) -> None:
        self._calls.update(self._compiled_calls)
        self._compiled_calls.clear()

    def _layer(self, attn: torch.nn.Module) -> int:
        if not torch.compiler.is_compiling() and attn in self._layers:
            self.check_bf16_layers()  # a layer runs again: every layer is numbered
        return self._layers.setdefault(attn, len(self._layers))

    def check_bf16_layers(self) -> None:
        """Once the layers are numbered, warn (once) about ``bf16_layers`` past the model's last layer: entries
        that match no call, most likely written for another model."""
        if self._bf16_layers_checked or not self._layers:
            return
        self._bf16_layers_checked = True
        count = len(self._layers)
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
        self,
        attn: torch.nn.Module,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        is_cross: bool,
        attn_mask: torch.Tensor | None = None,
        valid_len: int | None = None,
        pad_queries: bool = False,
    ) -> torch.Tensor:
        """Attention on ``(B, S, H, D)`` through the backend the policy picks; ``(B, S_q, H * D)`` out.

        ``valid_len``: ``attn_mask`` hides exactly the keys from this index on, in every batch row, so a backend
        that takes no mask runs on K/V trimmed to it; SDPA still gets the mask, which keeps its output identical
        to diffusers'. ``pad_queries``: the mask also hides the query rows from ``valid_len`` on, whose output is
        then zero (as SDPA gives a row with no key), so those rows are trimmed too.

        Under Ulysses (``_parallel_config`` set) self-attention exchanges sequence shards for head shards first and
        back after; cross-attention needs no exchange: each rank's query shard attends to the whole context.
        """
        self._check_step_tracking()
        sharded = self._parallel_config is not None and not is_cross
        if sharded:
            if attn_mask is not None:
                raise RuntimeError(f"{type(self).__name__}: masked self-attention under Ulysses is not supported")
            group = ulysses_group(self._parallel_config)
            q, k, v = (sequence_to_heads(x, group) for x in (q, k, v))
        trim = valid_len is not None
        q_seen = q[:, :valid_len] if trim and pad_queries else q
        layer = None if is_cross else self._layer(attn)
        has_mask = attn_mask is not None and not trim
        # watched_step, not step: a guard on the step would recompile a compiled model at every step.
        step = None if self.step_tracker is None else self.step_tracker.watched_step
        call = Call(q_seen, k, v, is_cross=is_cross, has_mask=has_mask, layer=layer, step=step)
        decision = decide(self.config, call)
        self._count("cross" if is_cross else "self", decision.backend)
        if trim and decision.backend != SDPA:
            out = run(decision, self.config, q_seen, k[:, :valid_len], v[:, :valid_len])
            out = F.pad(out, (0, 0, 0, 0, 0, q.shape[1] - q_seen.shape[1]))
        else:
            out = run(decision, self.config, q, k, v, attn_mask=attn_mask, attention_backend=self._attention_backend)
        if sharded:
            out = heads_to_sequence(out, group)
        return out.flatten(2, 3).type_as(q)
