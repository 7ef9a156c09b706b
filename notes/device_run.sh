#!/bin/bash
# Device side of a GPU check, run from the repo root. STAGES picks what runs, in the order given (unset or
# "none": only stash and install; a stash call on a machine that is still warm must not start a long run):
#   flavor    notes/kernel_check.py with the DSL's CUDA 13 flavor, then with its CUDA 12 flavor alone
#   prep      tests/test_sm90_prep.py, then notes/bench_sm90_prep.py (each launch, smoothing and repair steps)
#   tests     ${TESTS} (default tests/test_sm90_gpu.py): paths or node ids, split on spaces (so no -k expressions);
#             TESTS_TIMEOUT default 500 s (test_sm90_gpu.py with test_sm90_lse_gpu.py took 288 s on a fresh machine)
#   generate  examples/generate.py on the tiny Wan pipeline (stock attention, then Open-VC on the kernel); writing
#             the videos needs imageio-ffmpeg: EXTRA=1 after the calls carrying .whl/v1 and .whl/v2
#             (notes/clean_wheels.sh video)
#   bench     examples/bench_attention.py ${BENCH_ARGS} (every peer, each timed twice: BENCH_TIMEOUT default 450 s)
#   ncu       Nsight Compute on one forward-kernel launch at each of ${NCU_SHAPES} (default 32760x12;
#             notes/kernel_once.py); the preparation's launches instead with NCU_SCRIPT=prep_once.py
#             NCU_KERNELS="PackV|QuantizePerBlock|AbsmaxAndChannelSums|SelectRepairTokens" NCU_SKIP=5 NCU_COUNT=5
#             (NCU_SCRIPT_ARGS=rotary: the preparation rotating inside, NCU_SKIP=4 NCU_COUNT=4 for
#             "RotaryQuantizeQK|AbsmaxAndRotatedChannelSums|PackV|SelectRepairTokens")
#   pipeline  examples/bench_pipeline.py ${PIPELINE_ARGS}
#   ulysses   torchrun examples/bench_ulysses.py on every GPU of the machine ${ULYSSES_ARGS}
#   probe     notes/${PROBE} (default probe_variants.py; several names, split on spaces, run in turn), each a
#             same-process comparison of kernel variants
#   ring      examples/bench_ring_shards.py ${RING_ARGS} (R simulated key shards merged by their lse, vs the unsplit call)
#   inputs    examples/capture.py (tiny Wan on the GPU, ${CAPTURE_ARGS}) then bench_attention.py --inputs on its file
# Wheels: notes/clean_wheels.sh writes what a fresh `pip install .` resolves (less torch and its CUDA libraries,
# the image's own) into .whl/c1 .. .whl/cN, one folder per call (carry [".whl/cK"]); `notes/clean_wheels.sh lean`
# only what the image lacks for the GPU tests, probes and benches, in two folders (two calls instead of six). Each call stashes what it
# carries in /tmp/wheels; until every piece its MANIFEST names is there it exits 3 ("stashed"). Then the pieces
# are joined and installed with --no-deps into /tmp/site, which holds nothing else, and the checkout itself is
# installed from source into /tmp/project at every call (the tree travels anew each time).
# The benchmarks' peers come apart from those pieces: .whl/extra (flash-attn-4, quack-kernels; 1.3 MB, in the
# same call as a piece: carry [".whl/c6", ".whl/extra"]) and .whl/peers (fa3-fwd, nvidia-cudnn-frontend; 39 MB,
# a call of its own, before or after the pieces: carry [".whl/peers"]). Whatever wheels of theirs a call carries
# are stashed in /tmp/wheels-extra, outside the MANIFEST's count, and each one not installed yet is installed at
# once with --no-deps into /tmp/site-extra, on the path only where EXTRA=1: the GPU tests run on exactly what a
# fresh install resolves, while EXTRA=1 STAGES=bench times FA4, FA3 and cuDNN FP8 beside Open-VC.
set -u
export PYTHONUNBUFFERED=1
STASH=/tmp/wheels
SITE=/tmp/site
mkdir -p $STASH
# Copies what a folder carries into a stash, keeping what is there (cp -n warns on newer coreutils, and
# --update=none is missing from older ones).
stash() { for f in "$1"/*; do [ -e "$2/${f##*/}" ] || cp "$f" "$2/"; done; }
# The peers first: a call carrying only .whl/peers installs them and then stops at the pieces' check (exit 3).
EXTRA_STASH=/tmp/wheels-extra
EXTRA_SITE=/tmp/site-extra
mkdir -p $EXTRA_STASH $EXTRA_SITE
for d in .whl/extra .whl/peers .whl/v[0-9]*; do [ -d "$d" ] && stash "$d" $EXTRA_STASH; done
# A wheel over a call's share comes in parts (NAME.whl.part00, ...) with NAME.whl.parts, their count: joined once all came.
for count in $EXTRA_STASH/*.whl.parts; do
  wheel=${count%.parts}
  [ -f "$count" ] && [ ! -f "$wheel" ] || continue
  [ "$(ls "$wheel".part[0-9][0-9] 2>/dev/null | wc -l)" = "$(cat "$count")" ] || continue
  cat "$wheel".part[0-9][0-9] > "$wheel.joining" && mv "$wheel.joining" "$wheel"
done
for wheel in $EXTRA_STASH/*.whl; do
  [ -f "$wheel" ] && [ ! -f "$EXTRA_SITE/.installed-${wheel##*/}" ] || continue
  python3 -m pip install -q --no-index --no-deps --no-compile --target $EXTRA_SITE "$wheel" || exit 4
  touch "$EXTRA_SITE/.installed-${wheel##*/}"
done
for d in .whl/c*; do [ -d "$d" ] && stash "$d" $STASH; done
if [ ! -f $SITE/.installed ]; then
  [ -f $STASH/MANIFEST ] || { echo "stashed: $(ls $STASH | wc -l) files, no MANIFEST yet"; exit 3; }
  missing=$(cd $STASH && while read -r piece; do [ -f "$piece" ] || echo "$piece"; done < MANIFEST | wc -l)
  [ "$missing" = 0 ] || { echo "stashed: $(ls $STASH | wc -l) files, $missing pieces still to come"; exit 3; }
  for first in $STASH/*.part00; do
    [ -f "$first" ] && cat "${first%.part00}".part* > "${first%.part00}" && rm "${first%.part00}".part*
  done
  python3 -m pip install -q --no-index --no-deps --no-compile --target $SITE $STASH/*.whl || exit 4
  touch $SITE/.installed
fi
rm -rf /tmp/project
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/project . || exit 5
export PYTHONPATH=/tmp/project:$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages${EXTRA:+:$EXTRA_SITE}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.draw --format=csv
PYTEST="python3 -m pytest -q -p no:cacheprovider --timeout=120 -rfEs"
for stage in ${STAGES:-none}; do
  echo "== stage $stage ($(date +%T))"
  case $stage in
    none) ;;
    flavor)
      OPENVC_KERNEL_CACHE=/tmp/cache-cu13 timeout -k 5 200 python3 notes/kernel_check.py 2>&1 | tee $OUT/flavor13.log
      # The CUDA 12 flavor alone: the same site without the CUDA 13 flavor's files.
      rm -rf /tmp/site12 && cp -al $SITE /tmp/site12 && rm -rf /tmp/site12/nvidia_cutlass_dsl/cu13 \
        /tmp/site12/nvidia_cutlass_dsl/dsl_packages/cutlass/_mlir/_mlir_libs/_cutlass_ir.cu13.*
      PYTHONPATH=/tmp/project:/tmp/site12:/tmp/site12/nvidia_cutlass_dsl/dsl_packages OPENVC_KERNEL_CACHE=/tmp/cache-cu12 \
        timeout -k 5 200 python3 notes/kernel_check.py 2>&1 | tee $OUT/flavor12.log ;;
    prep)
      timeout -k 5 240 $PYTEST tests/test_sm90_prep.py 2>&1 | tee $OUT/prep.log | tail -n 15
      timeout -k 5 90 python3 notes/bench_sm90_prep.py 2>&1 | tee $OUT/prep_bench.log | tail -n 24 ;;
    tests)
      timeout -k 5 ${TESTS_TIMEOUT:-500} $PYTEST ${TESTS:-tests/test_sm90_gpu.py} 2>&1 | tee $OUT/pytest.log | tail -n 25 ;;
    generate)
      timeout -k 5 ${GENERATE_TIMEOUT:-200} python3 examples/generate.py --output /tmp/generate 2>&1 \
        | tee $OUT/generate.log | tail -n 12 ;;
    ncu)
      for shape in ${NCU_SHAPES:-32760x12}; do
        timeout -k 5 ${NCU_TIMEOUT:-150} ncu --clock-control none -k regex:${NCU_KERNELS:-ExpCastAttentionSm90} \
          --launch-skip ${NCU_SKIP:-1} --launch-count ${NCU_COUNT:-1} --section SpeedOfLight \
          --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section WarpStateStats \
          --section SchedulerStats --section Occupancy --section LaunchStats \
          --metrics sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,sm__cycles_elapsed.avg.per_second \
          python3 notes/${NCU_SCRIPT:-kernel_once.py} $shape ${NCU_SCRIPT_ARGS:-} 2>&1 | tee $OUT/ncu_$shape.log \
          | tail -n ${NCU_TAIL:-120}
      done ;;
    pipeline)
      timeout -k 5 ${PIPELINE_TIMEOUT:-400} python3 examples/bench_pipeline.py ${PIPELINE_ARGS:---size 480p,720p --steps 3} \
        --json $OUT/bench_pipeline.json 2>&1 | tee $OUT/bench_pipeline.log | grep -v "^    " ;;
    ulysses)
      timeout -k 10 ${ULYSSES_TIMEOUT:-300} torchrun --standalone --nproc-per-node $(nvidia-smi -L | wc -l) \
        examples/bench_ulysses.py ${ULYSSES_ARGS:-} --json $OUT/bench_ulysses.json 2>&1 | tee $OUT/bench_ulysses.log \
        | tail -n 40 ;;
    probe)
      for probe in ${PROBE:-probe_variants.py}; do
        echo "== probe $probe ($(date +%T))"
        timeout -k 5 ${PROBE_TIMEOUT:-200} python3 notes/$probe 2>&1 | tee $OUT/probe_${probe%.py}.log | tail -n 40
      done ;;
    inputs)
      timeout -k 5 ${INPUTS_TIMEOUT:-200} bash -c "python3 examples/capture.py --output $OUT/qkv.safetensors \
        ${CAPTURE_ARGS:---layers 0,1 --steps 0} && python3 examples/bench_attention.py --inputs $OUT/qkv.safetensors \
        --json $OUT/bench_inputs.json" 2>&1 | tee $OUT/bench_inputs.log | tail -n 20 ;;
    bench)
      timeout -k 5 ${BENCH_TIMEOUT:-450} python3 examples/bench_attention.py ${BENCH_ARGS:-} --json $OUT/bench.json 2>&1 \
        | tee $OUT/bench.log ;;
    ring)
      timeout -k 5 ${RING_TIMEOUT:-200} python3 examples/bench_ring_shards.py ${RING_ARGS:-} --json $OUT/bench_ring.json \
        2>&1 | tee $OUT/bench_ring.log | tail -n 20 ;;
  esac
done
