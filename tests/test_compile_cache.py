"""The on-disk kernel cache: compile once, load afterwards, survive bad files and unwritable folders (no GPU)."""

import logging

import pytest
import torch

from openvc_kernels import compile_cache, prep_ops, support

NAME = "prep_absmax_per_head_bfloat16"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(compile_cache.CACHE_ENV, str(tmp_path / "kernels"))
    monkeypatch.setattr(compile_cache, "_loaded", {})
    return tmp_path / "kernels"


def _compile():
    _compile.calls += 1
    return prep_ops.compile_prep("absmax_per_head", torch.bfloat16)


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


def test_a_missing_package_is_named_with_its_fix(cache, monkeypatch):
    # A fresh machine without apache-tvm-ffi: before, the DSL's compile failed with its own traceback.
    real_import = support.importlib.import_module

    def import_module(name):
        if name == "tvm_ffi":
            raise ModuleNotFoundError("No module named 'tvm_ffi'")
        return real_import(name)

    monkeypatch.setattr(support.importlib, "import_module", import_module)
    support.missing_package_reason.cache_clear()
    try:
        with pytest.raises(support.KernelUnavailableError) as raised:
            compile_cache.load_or_compile(NAME, _must_not_compile)
    finally:
        support.missing_package_reason.cache_clear()
    assert str(raised.value) == (
        "the FP8 kernel cannot be built: apache-tvm-ffi does not import (No module named 'tvm_ffi'); fix: "
        f"`pip install 'apache-tvm-ffi'` or {support.REINSTALL}"
    )


def test_a_failed_compile_names_its_first_line_and_the_fix(cache):
    def fails():
        raise RuntimeError("\x1b[91merror[PTXAS]:\x1b[0m unsupported .target sm_90a\n  long compiler log ...")

    with pytest.raises(support.KernelUnavailableError) as raised:
        compile_cache.load_or_compile(NAME, fails)
    message = str(raised.value)
    assert message.startswith(f"the FP8 kernel {NAME} failed to compile: RuntimeError: error[PTXAS]: unsupported")
    assert "long compiler log" not in message and support.REINSTALL in message
    assert isinstance(raised.value.__cause__, RuntimeError)  # the whole error stays chained


def test_the_cache_names_the_dsl_flavor(cache, monkeypatch):
    # The DSL loads the newest CUDA flavor the driver supports: a folder shared by two machines (or a driver
    # upgrade) must not hand one flavor's object file to the other.
    assert compile_cache.dsl_flavor().startswith("_cutlass_ir.cu")
    compile_cache._build_digest.cache_clear()
    before = compile_cache.kernel_path(NAME)
    monkeypatch.setattr(compile_cache, "dsl_flavor", lambda: "_cutlass_ir.cu99.so")
    compile_cache._build_digest.cache_clear()
    try:
        assert compile_cache.kernel_path(NAME) != before
    finally:
        compile_cache._build_digest.cache_clear()
