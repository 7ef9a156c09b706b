#!/bin/bash
# Here (the dev machine, which reaches PyPI): the wheels a fresh `pip install .` of this checkout resolves for the
# device machine (CPython 3.12, x86-64 Linux), minus torch and its CUDA libraries, which the device image has
# (torch pinned to the image's 2.11.0 so that the rest resolves against it). They are grouped into folders
# .whl/c1 .. .whl/c6 of at most 60 MB, one per device call (a call carries 64 MiB); the three wheels over that
# travel split in parts that notes/device_run.sh joins.
#   notes/clean_wheels.sh           everything a fresh install resolves (the GPU tests, the examples, the benches)
#   notes/clean_wheels.sh lean      only what the device image lacks for the GPU tests, the probes and the benches: the
#                                   kernel's stack (the DSL in its CUDA 13 flavor, TVM FFI, the DLPack extension,
#                                   CUDA's bindings) and diffusers with what it needs beyond the image (the image's
#                                   transformers, accelerate, numpy, ... stand in): two calls instead of six; not for
#                                   the flavor stage (no CUDA 12 flavor) or the generate stage (no imageio-ffmpeg)
#   notes/clean_wheels.sh video     imageio-ffmpeg alone, for the generate stage beside the lean set: its wheel (68 MB,
#                                   its own ffmpeg) in two halves, .whl/v1 and .whl/v2, one call each (device_run.sh
#                                   joins them once both came); the other folders stay
set -euo pipefail
mode=${1:-all}
[[ $mode == all || $mode == lean || $mode == video ]] || { echo "usage: $0 [lean|video]" >&2; exit 2; }
cd "$(dirname "$0")/.."
if [[ $mode == video ]]; then
  work=$(mktemp -d)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
    -d "$work" imageio-ffmpeg
  rm -rf .whl/v[0-9]* && mkdir -p .whl/v1 .whl/v2
  wheel=$(ls "$work"/*.whl) && name=${wheel##*/}
  split -n 2 -d -a 2 "$wheel" "$work/$name.part"
  for n in 1 2; do
    mv "$work/$name.part0$((n - 1))" .whl/v$n/ && echo 2 > ".whl/v$n/$name.parts"
    echo ".whl/v$n: $(du -b .whl/v$n | cut -f1) bytes"
  done
  rm -rf "$work"
  exit 0
fi
work=$(mktemp -d)
platforms=""
for n in 39 35 34 31 28 27 26 25 24 18 17 12 5; do platforms+=" --platform manylinux_2_${n}_x86_64"; done
echo "torch==2.11.0" > "$work/constraints.txt"
PIP_CONSTRAINT= python3 -m pip install -q --dry-run --ignore-installed --report "$work/report.json" \
  -c "$work/constraints.txt" --python-version 3.12 --implementation cp $platforms --platform manylinux2014_x86_64 \
  --platform manylinux2010_x86_64 --platform manylinux1_x86_64 --only-binary=:all: --target "$work/t" .
rm -rf .whl/clean .whl/parts .whl/c[0-9]* && mkdir -p .whl/clean
python3 - "$work/report.json" .whl/clean "$mode" <<'EOF'
import json, re, shutil, sys, urllib.request
from pathlib import Path

report, folder, mode = json.load(open(sys.argv[1])), Path(sys.argv[2]), sys.argv[3]
LEAN = {
    "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base", "nvidia-cutlass-dsl-libs-core",
    "nvidia-cutlass-dsl-libs-cu13", "apache-tvm-ffi", "torch-c-dlpack-ext", "cuda-bindings", "cuda-pathfinder",
    "diffusers", "aenum", "importlib-metadata",
}
for item in report["install"]:
    name = re.sub(r"[-_.]+", "-", item["metadata"]["name"]).lower()
    torch_side = name in ("torch", "triton", "cuda-toolkit") or (name.startswith("nvidia-") and "cutlass" not in name)
    if torch_side or name == "openvc-diffusers" or (mode == "lean" and name not in LEAN):
        continue
    url = item["download_info"]["url"]
    target = folder / url.rsplit("/", 1)[-1].split("#")[0]
    if url.startswith("file://"):
        shutil.copy(url.removeprefix("file://"), target)
    else:
        urllib.request.urlretrieve(url, target)
EOF
python3 - .whl <<'EOF'
import os, sys
from pathlib import Path

root, limit, part = Path(sys.argv[1]), 60_000_000, 46 * 2**20
pieces = []  # (path, size): whole wheels, and parts of the ones over a call's share
for wheel in sorted((root / "clean").iterdir()):
    size = wheel.stat().st_size
    if size <= limit:
        pieces.append((wheel, size))
        continue
    data = wheel.read_bytes()
    for index in range(0, size, part):
        path = root / "parts" / f"{wheel.name}.part{index // part:02d}"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(data[index : index + part])
        pieces.append((path, path.stat().st_size))
calls = []  # first fit, largest first
for path, size in sorted(pieces, key=lambda p: -p[1]):
    call = next((c for c in calls if c[0] + size <= limit), None)
    if call is None:
        calls.append(call := [0, []])
    call[0] += size
    call[1].append(path)
manifest = "".join(f"{path.name}\n" for path, _ in sorted(pieces))
for number, (size, paths) in enumerate(calls, 1):
    folder = root / f"c{number}"
    folder.mkdir()
    for path in paths:
        os.link(path, folder / path.name)
    (folder / "MANIFEST").write_text(manifest)  # every call's folder names all the pieces: the device knows when it has them
    print(f"{folder}: {len(paths)} files, {size / 1e6:.1f} MB")
EOF
rm -rf "$work"
