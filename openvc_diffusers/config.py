"""Open-VC policy settings: a frozen dataclass, read from YAML and checked whenever it is built."""

from __future__ import annotations

import difflib
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from openvc_kernels.repair import REPAIR_RANKINGS
from openvc_kernels.validation import MAX_REPAIR_RATIO

OPENVC, FA4, SDPA = "openvc", "fa4", "sdpa"
"""The backends a config names: Open-VC (the Hopper kernel, or its reference off the GPU), FlashAttention-4 and
diffusers' own dispatch (SDPA by default)."""
BACKENDS = (OPENVC, FA4, SDPA)

# "28-29": an inclusive range of layer or step indices.
_RANGE = re.compile(r"\s*([0-9]+)\s*-\s*([0-9]+)\s*")


class ConfigError(ValueError):
    """A config key or value Open-VC cannot use; the message names the key and what is accepted."""


@dataclass(frozen=True)
class OpenVCConfig:
    # Order tried for self-attention; "sdpa" must end it: it takes every call, so every call has a backend.
    backends: tuple[str, ...] = BACKENDS
    # Self-attention calls with fewer query tokens than this skip the FP8 path.
    min_tokens: int = 1024
    # V residual repair ratio rho: fraction of tokens per head given an extra repair row (0 = off). At 0.005 on
    # the H200: ~7% less error on V with heavy-tailed token norms for about 1% of the call (README).
    repair_ratio: float = 0.005
    # How repair candidates are ranked: "energy" (residual energy alone) or "attention" (residual energy times the
    # attention mass the key gets from sampled query rows: better where a few keys draw most of the attention,
    # about 2% more time at 75,600 tokens).
    repair_ranking: str = "energy"
    # Mid-window traversal width w; None keeps plain key-block order.
    window: int | None = 4
    # Subtract each head's per-channel mean of K (of every 8th key) before quantizing (softmax is unchanged in exact
    # math): 16% less error where K channels carry offsets, for one reduction over an eighth of K.
    smooth_k: bool = True
    # Backend for cross-attention (text/image context).
    cross_attention: str = SDPA
    # Layer indices forced to BF16 (the backends chain without "openvc").
    bf16_layers: frozenset[int] = frozenset()
    # Denoising step indices (0-based) forced to BF16.
    bf16_steps: frozenset[int] = frozenset()
    # Ulysses sequence-parallel degree (heads exchanged for sequence); YAML key `parallel.ulysses_degree`.
    ulysses_degree: int = 1
    # Ring degree (K/V shards passed among ranks, outputs merged by log-sum-exp); YAML key `parallel.ring_degree`.
    # ulysses_degree x ring_degree processes share one sequence.
    ring_degree: int = 1

    def __post_init__(self):
        # Checked here rather than in load_config, so dataclasses.replace() is validated too.
        checked = {
            "backends": _backends("backends", self.backends),
            "min_tokens": _int("min_tokens", self.min_tokens, minimum=0),
            "repair_ratio": _ratio("repair_ratio", self.repair_ratio),
            "repair_ranking": _choice("repair_ranking", self.repair_ranking, REPAIR_RANKINGS),
            "window": _int("window", self.window, minimum=0, none_ok=True),
            "smooth_k": _bool("smooth_k", self.smooth_k),
            "cross_attention": _backend("cross_attention", self.cross_attention),
            "bf16_layers": _indices("bf16_layers", self.bf16_layers),
            "bf16_steps": _indices("bf16_steps", self.bf16_steps),
            "ulysses_degree": _int("parallel.ulysses_degree", self.ulysses_degree, minimum=1),
            "ring_degree": _int("parallel.ring_degree", self.ring_degree, minimum=1),
        }
        for name, value in checked.items():
            object.__setattr__(self, name, value)
        # The kernel options as text, for backends.kernel_options: torch.compile hands a str to a constant lookup as
        # it is, where it cannot pass this frozen dataclass (torch 2.11) and turns floats read from it symbolic.
        object.__setattr__(self, "kernel_options_text", json.dumps(self.kernel_options))

    @property
    def kernel_options(self) -> dict[str, Any]:
        """The keyword arguments the kernel's complete call and the reference take from this config."""
        return {
            "window": self.window,
            "smooth_k": self.smooth_k,
            "repair_ratio": self.repair_ratio,
            "repair_ranking": self.repair_ranking,
        }

    def to_dict(self) -> dict[str, Any]:
        """The YAML-shaped dict: `load_config(cfg.to_dict()) == cfg`."""
        return {
            "backends": list(self.backends),
            "min_tokens": self.min_tokens,
            "repair_ratio": self.repair_ratio,
            "repair_ranking": self.repair_ranking,
            "window": self.window,
            "smooth_k": self.smooth_k,
            "cross_attention": self.cross_attention,
            "bf16_layers": sorted(self.bf16_layers),
            "bf16_steps": sorted(self.bf16_steps),
            "parallel": {"ulysses_degree": self.ulysses_degree, "ring_degree": self.ring_degree},
        }


_PARALLEL_KEYS = ("ulysses_degree", "ring_degree")
_TOP_KEYS = tuple(k for k in OpenVCConfig.__dataclass_fields__ if k not in _PARALLEL_KEYS) + ("parallel",)
# Dotted names, so a nested key written at the top level is pointed to its section.
_ALL_KEYS = _TOP_KEYS + tuple(f"parallel.{k}" for k in _PARALLEL_KEYS)


ENV_VAR = "OPENVC_CONFIG"
"""Names the YAML file that ``load_config(None)`` reads instead of the defaults."""


def load_config(source: OpenVCConfig | Mapping[str, Any] | str | os.PathLike | None = None) -> OpenVCConfig:
    """Build a config from nothing (the file ``$OPENVC_CONFIG`` names, else the defaults), a config, a
    YAML-shaped dict, or a YAML file path."""
    if source is None:
        path = os.environ.get(ENV_VAR)
        return _from_mapping(_read_yaml(Path(path))) if path else OpenVCConfig()
    if isinstance(source, OpenVCConfig):
        return source
    if isinstance(source, (str, os.PathLike)):
        return _from_mapping(_read_yaml(Path(source)))
    if isinstance(source, Mapping):
        return _from_mapping(source)
    raise TypeError(f"load_config takes None, an OpenVCConfig, a dict or a YAML path, not {type(source).__name__}")


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (it would keep the last one silently)."""

    MERGE_TAG = "tag:yaml.org,2002:merge"

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == self.MERGE_TAG:  # `<<: *base`: keys written next to it override the merged ones
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                given_twice = key in seen
            except TypeError:  # an unhashable key: the safe loader refuses it with its own error
                continue
            if given_twice:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice; keep one", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: Path) -> Mapping[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file not found: {str(path)!r}")
    try:
        data = yaml.load(path.read_text(), Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        raise ConfigError(f"{str(path)!r} is not valid YAML: {e}") from e
    if data is None:  # an empty file means all defaults
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"{str(path)!r}: expected a mapping of config keys at the top level, got {type(data).__name__}"
        )
    return data


def _from_mapping(data: Mapping[str, Any]) -> OpenVCConfig:
    _check_keys(data, _TOP_KEYS, prefix="")
    kwargs = {k: v for k, v in data.items() if k != "parallel"}
    if "parallel" in data:
        parallel = data["parallel"]
        if not isinstance(parallel, Mapping):
            raise ConfigError(
                f"parallel: got {parallel!r}; expected a mapping such as {{ulysses_degree: 2, ring_degree: 2}}"
            )
        _check_keys(parallel, _PARALLEL_KEYS, prefix="parallel.")
        kwargs.update(parallel)
    return OpenVCConfig(**kwargs)


def _check_keys(data: Mapping[str, Any], known: tuple[str, ...], prefix: str):
    for key in data:
        if key in known:
            continue
        name = f"{prefix}{key}"
        pool = _ALL_KEYS if not prefix else tuple(prefix + k for k in known)
        close = difflib.get_close_matches(name, pool, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        where = f" under {prefix[:-1]!r}" if prefix else ""
        raise ConfigError(f"unknown key {name!r}.{hint} Known keys{where}: {', '.join(known)}")


def _fail(key: str, value: Any, accepted: str):
    raise ConfigError(f"{key}: got {value!r}; expected {accepted}{_text_number_hint(value)}")


_NUMBER_TEXT = re.compile(r"\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*")


def _text_number_hint(value: Any) -> str:
    """For a number that YAML read as text: why (PyYAML follows YAML 1.1, where ``1e-2`` is not a float)."""
    if not isinstance(value, str) or not _NUMBER_TEXT.fullmatch(value):
        return ""
    return " (this number was read as text: write it unquoted, with a dot before any exponent, e.g. 1.0e-2 or 0.01)"


def _int(key: str, value: Any, minimum: int, none_ok: bool = False) -> int | None:
    if none_ok and value is None:
        return None
    # bool is an int subclass, but `min_tokens: true` is a mistake, not 1.
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        _fail(key, value, f"an int >= {minimum}" + (" or null" if none_ok else ""))
    return value


def _bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        _fail(key, value, "true or false")
    return value


def _ratio(key: str, value: Any) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or not 0 <= value <= MAX_REPAIR_RATIO:
        _fail(key, value, f"a finite number in [0, {MAX_REPAIR_RATIO}]")
    return float(value)


def _choice(key: str, value: Any, accepted: tuple[str, ...]) -> str:
    if value not in accepted:
        _fail(key, value, f"one of {', '.join(map(repr, accepted))}")
    return value


def _backend(key: str, value: Any) -> str:
    return _choice(key, value, BACKENDS)


def _backends(key: str, value: Any) -> tuple[str, ...]:
    # A bare string would silently split into characters.
    if not isinstance(value, (list, tuple)) or not value:
        _fail(key, value, f"a non-empty list of {', '.join(map(repr, BACKENDS))}")
    for name in value:
        _backend(key, name)
    if len(set(value)) != len(value):
        _fail(key, value, "each backend at most once")
    if SDPA not in value:
        _fail(key, value, f"a list that includes {SDPA!r}: it is the one backend that runs everywhere")
    if value[-1] != SDPA:
        _fail(key, value, f"{SDPA!r} last: it takes every call, so no backend after it would ever run")
    return tuple(value)


MAX_INDEX = 9_999
"""The largest layer or step index a config may name: no video DiT has 10,000 layers or steps, and a range is
expanded into a set (``'0-1000000000'`` would take all memory)."""


def _indices(key: str, value: Any) -> frozenset[int]:
    items = value if isinstance(value, (list, tuple, set, frozenset)) else [value]
    accepted = f"ints in [0, {MAX_INDEX}] or inclusive ranges 'a-b' with a <= b <= {MAX_INDEX}, e.g. [0, 1, '28-29']"
    out = set()
    for item in items:
        if isinstance(item, int) and not isinstance(item, bool) and 0 <= item <= MAX_INDEX:
            out.add(item)
            continue
        m = _RANGE.fullmatch(item) if isinstance(item, str) else None
        if m is None or not int(m[1]) <= int(m[2]) <= MAX_INDEX:
            _fail(key, item, accepted)
        out.update(range(int(m[1]), int(m[2]) + 1))
    return frozenset(out)


def format_indices(indices) -> str:
    """Sorted indices with runs as ranges, as a config writes them: ``[0, 28, 29, 30]`` -> ``'0, 28-30'``."""
    runs: list[list[int]] = []
    for index in sorted(indices):
        if runs and index == runs[-1][1] + 1:
            runs[-1][1] = index
        else:
            runs.append([index, index])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
