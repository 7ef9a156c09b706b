#!/bin/bash
# Device side of a GPU check, run from the repo root: install the carried wheels, then the GPU tests and the
# benchmark. libs-cu13 is over one call's carry limit, so a cold machine takes two calls: the first carries
# .whl/a (exit 3: "stashed"), the second .whl/b; a warm machine with /tmp/site installed needs neither.
set -u
export PYTHONUNBUFFERED=1
STASH=/tmp/wheels
mkdir -p $STASH
for d in .whl/a .whl/b; do [ -d $d ] && cp -n $d/* $STASH/; done
if [ ! -f /tmp/site/.installed ]; then
  [ -f $STASH/cu13part_aa ] && [ -f $STASH/cu13part_ab ] || { echo "stashed: $(ls $STASH)"; exit 3; }
  cat $STASH/cu13part_aa $STASH/cu13part_ab > $STASH/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $STASH/*.whl || exit 4
  touch /tmp/site/.installed
fi
mkdir -p /tmp/pkg && ln -sfn "$PWD/kernels" /tmp/pkg/openvc_kernels
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:/tmp/pkg
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv
# conftest imports diffusers, which the device image lacks; the sm90 tests need none of it.
timeout 300 python3 -m pytest ${TESTS:-tests/test_sm90_prep.py tests/test_sm90_gpu.py} -q --noconftest \
  -p no:cacheprovider --timeout=120 -rfEs 2>&1 | tee $OUT/pytest.log | tail -n 25
timeout ${BENCH_TIMEOUT:-280} python3 examples/bench_attention.py ${BENCH_ARGS:-} --json $OUT/bench.json 2>&1 | tee $OUT/bench.log
