"""The package as a fresh process sees it: the checkout's ``kernels`` folder is ``openvc_kernels`` and nothing else, and
its kernels compile for sm_90a on a machine without a GPU whatever was imported first."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_kernels_folder_is_not_a_second_copy_of_the_package():
    """From the checkout's root, ``kernels`` is importable by that name: transformers imports it, taking it for the
    Hugging Face package (which it requires from 5.25 on). A second copy of our modules would register the custom op
    again, bound to a second compile cache (the GPU tests' patched cache went unseen that way): the name goes to
    Hugging Face's package where it is installed, and none of our modules runs under it. (Ours: files in the
    checkout's ``kernels`` folder; a virtualenv inside the checkout holds Hugging Face's.)"""
    code = (
        "import importlib.metadata, sys, kernels, openvc_diffusers, openvc_kernels\n"
        f"root = {str(ROOT / 'kernels') + os.sep!r}\n"
        "ours = sorted(name for name, module in list(sys.modules.items()) if name.split('.')[0] == 'kernels'\n"
        "              and (getattr(module, '__file__', None) or '').startswith(root))\n"
        "try:\n"
        "    theirs = importlib.metadata.version('kernels')\n"
        "except importlib.metadata.PackageNotFoundError:\n"
        "    theirs = None\n"
        "print(ours, hasattr(kernels, 'attention'), theirs is None or kernels.__file__ is not None)"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[] False True"


def test_kernels_compile_for_sm90_without_a_gpu_after_the_dsl_was_imported(tmp_path):
    """The DSL reads ``CUTE_DSL_ARCH`` once, at its first import (here before any compile, by the preparation
    module); the compiles name their target instead, so the forward kernel still builds for sm_90a."""
    pytest.importorskip("cutlass")
    env = {key: value for key, value in os.environ.items() if key != "CUTE_DSL_ARCH"}
    env.update(OPENVC_KERNEL_CACHE=str(tmp_path), CUDA_VISIBLE_DEVICES="")
    code = (
        "import torch\n"
        "from openvc_kernels import ops, prep_ops\n"
        "from openvc_kernels.sm90.config import ForwardConfig\n"
        "prep_ops.load_prep('absmax_per_head', torch.bfloat16)\n"
        "ops._kernel(ForwardConfig(plain_order=False))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(list(tmp_path.glob("*.o"))) == 2
