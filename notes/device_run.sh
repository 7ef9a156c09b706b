#!/bin/bash
# Device side of a GPU check, run from the repo root. STAGES picks what runs, in the order given (unset or
# "none": only install; a stash call on a machine that is still warm must not start a long run):
#   prep   tests/test_sm90_prep.py, then notes/bench_sm90_prep.py (each launch, smoothing and repair steps)
#   tests  ${TESTS} (default tests/test_sm90_gpu.py)
#   bench  examples/bench_attention.py ${BENCH_ARGS}
#   ncu    Nsight Compute on one forward-kernel launch at 32,760 x 12 (notes/kernel_once.py)
#   pipeline  examples/bench_pipeline.py ${PIPELINE_ARGS}
#   ulysses   torchrun examples/bench_ulysses.py on every GPU of the machine ${ULYSSES_ARGS}
#   probe  notes/${PROBE} (default probe_variants.py), a same-process comparison of kernel variants
#   inputs examples/capture.py (tiny Wan on the GPU, ${CAPTURE_ARGS}) then bench_attention.py --inputs on its file
# libs-cu13 is over one call's carry limit, so a cold machine takes two calls: the first carries .whl/a (exit 3:
# "stashed"), the second .whl/b; a warm machine with /tmp/site installed needs neither.
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
mkdir -p /tmp/pkg && ln -sfn "$PWD/kernels" /tmp/pkg/openvc_kernels && ln -sfn "$PWD/openvc_diffusers" /tmp/pkg/openvc_diffusers
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:/tmp/pkg
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv
# conftest imports diffusers, which the device image lacks; the sm90 tests need none of it.
PYTEST="python3 -m pytest -q ${PYTEST_CONFTEST-"--noconftest"} -p no:cacheprovider --timeout=120 -rfEs"
for stage in ${STAGES:-none}; do
  echo "== stage $stage ($(date +%T))"
  case $stage in
    none) ;;
    prep)
      timeout -k 5 240 $PYTEST tests/test_sm90_prep.py 2>&1 | tee $OUT/prep.log | tail -n 15
      timeout -k 5 90 python3 notes/bench_sm90_prep.py 2>&1 | tee $OUT/prep_bench.log | tail -n 24 ;;
    tests)
      timeout -k 5 ${TESTS_TIMEOUT:-300} $PYTEST ${TESTS:-tests/test_sm90_gpu.py} 2>&1 | tee $OUT/pytest.log | tail -n 25 ;;
    ncu)
      timeout -k 5 ${NCU_TIMEOUT:-150} ncu --clock-control none -k regex:ExpCastAttentionSm90 --launch-skip 1 \
        --launch-count 1 --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
        --section SchedulerStats --section Occupancy --section LaunchStats \
        --metrics sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,sm__cycles_elapsed.avg.per_second \
        python3 notes/kernel_once.py 2>&1 | tee $OUT/ncu.log | tail -n 120 ;;
    pipeline)
      timeout -k 5 ${PIPELINE_TIMEOUT:-400} python3 examples/bench_pipeline.py ${PIPELINE_ARGS:---size 480p,720p --steps 3} \
        --json $OUT/bench_pipeline.json 2>&1 | tee $OUT/bench_pipeline.log | grep -v "^    " ;;
    ulysses)
      timeout -k 10 ${ULYSSES_TIMEOUT:-300} torchrun --standalone --nproc-per-node $(nvidia-smi -L | wc -l) \
        examples/bench_ulysses.py ${ULYSSES_ARGS:-} --json $OUT/bench_ulysses.json 2>&1 | tee $OUT/bench_ulysses.log \
        | tail -n 40 ;;
    probe)
      timeout -k 5 ${PROBE_TIMEOUT:-200} python3 notes/${PROBE:-probe_variants.py} 2>&1 | tee $OUT/probe.log | tail -n 40 ;;
    inputs)
      timeout -k 5 ${INPUTS_TIMEOUT:-200} bash -c "python3 examples/capture.py --output $OUT/qkv.safetensors \
        ${CAPTURE_ARGS:---layers 0,1 --steps 0} && python3 examples/bench_attention.py --inputs $OUT/qkv.safetensors \
        --json $OUT/bench_inputs.json" 2>&1 | tee $OUT/bench_inputs.log | tail -n 20 ;;
    bench)
      timeout -k 5 ${BENCH_TIMEOUT:-280} python3 examples/bench_attention.py ${BENCH_ARGS:-} --json $OUT/bench.json 2>&1 \
        | tee $OUT/bench.log ;;
  esac
done
