"""argparse types for the example scripts' arguments: each checks its value while the command line is parsed,
before a script loads or runs anything, and refuses a bad one with a one-line message naming the value and what
is accepted (argparse prints it as ``prog: error: argument --flag: ...`` and exits with status 2)."""

import argparse
import math
import os
from collections.abc import Iterable
from pathlib import Path

import torch

from .config import OpenVCConfig, load_config
from .parallel import describe_degrees


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: expected an integer >= 1")
    return value


def nonnegative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value}: expected an integer >= 0")
    return value


def nonnegative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{text}: expected a finite number >= 0")
    return value


def seed(text: str) -> int:
    """A seed torch takes: its generators hold 64 bits, signed or not."""
    value = _int(text)
    if not -(2**63) <= value < 2**64:
        raise argparse.ArgumentTypeError(f"{value}: expected a seed from -2**63 to 2**64 - 1")
    return value


def names_from(choices: Iterable[str], what: str):
    """An argparse type: comma-separated names, each one of ``choices`` and given once (``what`` names them in
    errors)."""
    choices = list(choices)

    def parse(text: str) -> list[str]:
        names = text.split(",")
        unknown = [name for name in names if name not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {', '.join(map(repr, unknown))}; choose from {', '.join(choices)}"
            )
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise argparse.ArgumentTypeError(f"{what} {', '.join(twice)} given more than once in {text!r}")
        return names

    return parse


def available_devices() -> list[str]:
    cuda = [f"cuda:{i}" for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return ["cpu", *(["cuda"] if cuda else []), *cuda]


def device(text: str) -> str:
    """A device of this machine: cpu, cuda (the current GPU) or cuda:N."""
    choices = ", ".join(available_devices())
    try:
        parsed = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device; choose from {choices}") from None
    if parsed.type == "cpu" and parsed.index in (None, 0):
        return text
    if parsed.type != "cuda":
        raise argparse.ArgumentTypeError(f"{text!r}: the scripts run on cpu or cuda; choose from {choices}")
    if not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: torch sees no CUDA GPU on this machine; choose from {choices}")
    if (parsed.index or 0) >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise argparse.ArgumentTypeError(
            f"{text!r}: this machine has {count} CUDA GPU{'s' * (count > 1)}; choose from {choices}"
        )
    return text


def config(text: str) -> OpenVCConfig:
    """A YAML config file, loaded (and so checked) by ``load_config``."""
    try:
        return load_config(text)
    except (ValueError, OSError) as e:  # ConfigError, or a file that cannot be read
        # YAML syntax errors span lines; the message has to stay one.
        raise argparse.ArgumentTypeError(" ".join(str(e).split())) from None


def single_process_config(text: str) -> OpenVCConfig:
    """``config`` for a script that runs in one process: parallel degrees above 1 are refused here, before the
    script loads a model (``apply`` would refuse them only then)."""
    loaded = config(text)
    if loaded.ulysses_degree * loaded.ring_degree > 1:
        degrees = describe_degrees(loaded.ulysses_degree, loaded.ring_degree)
        raise argparse.ArgumentTypeError(
            f"{text!r} sets {degrees}, which needs one process per GPU; this script runs in one process: take a "
            "config without parallel degrees, or shard in a torchrun script of your own (examples/bench_ulysses.py)"
        )
    return loaded


def writable_dir(text: str) -> str:
    """A directory that is writable, or can be created (the script creates it when it writes)."""
    path = Path(text)
    if path.exists():
        if not path.is_dir():
            raise argparse.ArgumentTypeError(f"{text!r} is a file, not a directory")
        if not os.access(path, os.W_OK | os.X_OK):
            raise argparse.ArgumentTypeError(f"{text!r}: directory not writable")
        return text
    _check_creatable(text, path)
    return text


def writable_file(text: str) -> str:
    """A file path that can be written: an existing writable file, or a new one in a writable or creatable
    directory (the script creates it when it writes)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; expected a file path")
    if path.exists():
        if not os.access(path, os.W_OK):
            raise argparse.ArgumentTypeError(f"{text!r}: file not writable")
        return text
    _check_creatable(text, path)
    return text


def _check_creatable(text: str, path: Path) -> None:
    """``path`` does not exist: its nearest existing ancestor must be a writable directory."""
    ancestor = next(parent for parent in path.absolute().parents if parent.exists())
    if not ancestor.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} cannot be created: {str(ancestor)!r} is not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text!r} cannot be created: {str(ancestor)!r} is not writable")


def create_parent(path: str) -> None:
    """The folder ``path`` is written into, created if missing."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
