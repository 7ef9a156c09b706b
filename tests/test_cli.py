"""openvc_diffusers.cli: the argparse types the example scripts share (their use in each script: test_examples)."""

import argparse
import os

import pytest
import torch

from openvc_diffusers import OpenVCConfig, cli


def refused(check, text: str) -> str:
    with pytest.raises(argparse.ArgumentTypeError) as error:
        check(text)
    message = str(error.value)
    assert "\n" not in message
    return message


def test_numbers():
    assert cli.positive_int("3") == 3 and cli.nonnegative_int("0") == 0 and cli.nonnegative_float("0") == 0.0
    assert refused(cli.positive_int, "1.5") == "'1.5' is not an integer"
    assert refused(cli.nonnegative_int, "-2") == "-2: expected an integer >= 0"
    assert refused(cli.nonnegative_float, "-inf") == "-inf: expected a finite number >= 0"
    assert cli.seed(str(-(2**63))) == -(2**63) and cli.seed(str(2**64 - 1)) == 2**64 - 1
    assert refused(cli.seed, str(-(2**63) - 1)) == f"{-(2**63) - 1}: expected a seed from -2**63 to 2**64 - 1"


def test_names_keep_their_order():
    sizes = cli.names_from(["480p", "720p"], "size")
    assert sizes("720p,480p") == ["720p", "480p"]
    assert refused(sizes, "480p,") == "unknown size ''; choose from 480p, 720p"


@pytest.mark.parametrize("gpus", [0, 2])
def test_devices(gpus, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    choices = "cpu, cuda, cuda:0, cuda:1" if gpus else "cpu"
    assert cli.available_devices() == choices.split(", ")
    for text in ["cpu", "cpu:0", *(["cuda", "cuda:0", "cuda:1"] if gpus else [])]:
        assert cli.device(text) == text
    assert refused(cli.device, "cpu:1") == f"'cpu:1': the scripts run on cpu or cuda; choose from {choices}"
    assert refused(cli.device, "cuda:") == f"'cuda:' is not a device; choose from {choices}"
    expected = "this machine has 2 CUDA GPUs" if gpus else "torch sees no CUDA GPU on this machine"
    assert refused(cli.device, "cuda:2") == f"'cuda:2': {expected}; choose from {choices}"


def test_config_is_loaded_while_parsing(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text("min_tokens: 0\n")
    assert cli.config(str(path)) == OpenVCConfig(min_tokens=0)
    assert refused(cli.config, str(tmp_path)) == f"config file not found: {str(tmp_path)!r}"
    assert cli.single_process_config(str(path)) == OpenVCConfig(min_tokens=0)


def test_a_single_process_script_refuses_parallel_degrees():
    ulysses = os.path.join(os.path.dirname(__file__), "..", "configs", "ulysses2.yaml")
    assert cli.config(ulysses).ulysses_degree == 2
    assert refused(cli.single_process_config, ulysses) == (
        f"{ulysses!r} sets parallel.ulysses_degree 2, which needs one process per GPU; this script runs in one "
        "process: take a config without parallel degrees, or shard in a torchrun script of your own "
        "(examples/bench_ulysses.py)"
    )


def test_writable_paths(tmp_path, monkeypatch):
    new = tmp_path / "a" / "b"
    assert cli.writable_dir(str(new)) == str(new) and cli.writable_file(str(new / "x.json")) == str(new / "x.json")
    assert not new.exists()  # checking creates nothing: the script does when it writes
    cli.create_parent(str(new / "x.json"))
    assert new.is_dir()
    file = new / "x.json"
    file.write_text("{}")
    assert cli.writable_file(str(file)) == str(file)
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    assert refused(cli.writable_file, str(file)) == f"{str(file)!r}: file not writable"
