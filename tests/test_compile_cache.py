"""The on-disk kernel cache: compile once, load afterwards, survive bad files and unwritable folders (no GPU)."""

import logging

import pytest
import torch

from openvc_kernels import compile_cache
from openvc_kernels.sm90 import prep

NAME = "prep_absmax_per_head_bfloat16"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(compile_cache.CACHE_ENV, str(tmp_path / "kernels"))
    monkeypatch.setattr(compile_cache, "_loaded", {})
    return tmp_path / "kernels"


def _compile():
    _compile.calls += 1
    return prep.compile_prep("absmax_per_head", torch.bfloat16)


def _must_not_compile():
    raise AssertionError("compiled although the cache holds the kernel")


def test_second_process_loads_instead_of_compiling(cache):
    _compile.calls = 0
    first = compile_cache.load_or_compile(NAME, _compile)
    assert _compile.calls == 1 and compile_cache.kernel_path(NAME).is_file()
    assert compile_cache.load_or_compile(NAME, _must_not_compile) is first  # same process: memory
    compile_cache._loaded.clear()  # a new process
    loaded = compile_cache.load_or_compile(NAME, _must_not_compile)
    assert callable(loaded) and type(loaded).__name__ == "Function"  # a TVM-FFI function from the object file
    assert [p.name for p in cache.iterdir()] == [compile_cache.kernel_path(NAME).name]  # no temporary left


def test_a_corrupt_file_is_recompiled(cache, caplog):
    path = compile_cache.kernel_path(NAME)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not an object file")
    _compile.calls = 0
    with caplog.at_level(logging.WARNING):
        compile_cache.load_or_compile(NAME, _compile)
    assert _compile.calls == 1 and "did not load" in caplog.text
    compile_cache._loaded.clear()
    compile_cache.load_or_compile(NAME, _must_not_compile)


def test_an_unwritable_cache_only_costs_the_compile(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(compile_cache.CACHE_ENV, str(blocker / "kernels"))  # a folder inside a file
    monkeypatch.setattr(compile_cache, "_loaded", {})
    with caplog.at_level(logging.WARNING):
        assert callable(compile_cache.load_or_compile(NAME, _compile))
    assert "stay in memory" in caplog.text


def test_the_key_changes_with_the_dsl_version(cache, monkeypatch):
    before = compile_cache.kernel_path(NAME)
    compile_cache._build_digest.cache_clear()
    monkeypatch.setattr(compile_cache.importlib.metadata, "version", lambda name: "0.0-other")
    try:
        assert compile_cache.kernel_path(NAME) != before
    finally:
        compile_cache._build_digest.cache_clear()
