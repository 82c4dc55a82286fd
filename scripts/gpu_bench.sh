#!/usr/bin/env bash
# On a CUDA machine whose python already has torch (+ triton, transformers, pytest): install onecat
# without touching its packages, run the GPU tests, the GEMV sweep, the step profile and the decode
# benchmark.   scripts/gpu_bench.sh OUTDIR [tests|gemv|profile|bench]...   (default: all four)
set -uo pipefail
out=${1:?usage: scripts/gpu_bench.sh OUTDIR [tests|gemv|profile|bench]...}; shift
steps=${*:-tests gemv profile bench}
mkdir -p "$out"
python3 -m pip install --no-deps --no-build-isolation -q -e . >"$out/install.log" 2>&1 || {
  echo "install failed, see $out/install.log"; tail -5 "$out/install.log"; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv >"$out/gpu.txt" 2>&1
for step in $steps; do
  case $step in
    tests) timeout 420 python3 -m pytest -q -p no:cacheprovider -m "gpu or not slow" \
             tests/test_fused_kernels_gpu.py tests/test_gemv_gpu.py tests/test_gpu_engine.py >"$out/tests.log" 2>&1
           echo "tests rc=$?"; tail -3 "$out/tests.log" ;;
    gemv) (cd benchmarks && timeout 300 python3 gpu_gemv.py ${GEMV_ARGS:-} --out "$out/gemv.json" \
             >"$out/gemv.log" 2>&1); echo "gemv rc=$?"; tail -16 "$out/gemv.log" ;;
    profile) (cd benchmarks && timeout 240 python3 gpu_step_profile.py --out "$out/step_profile.json" \
             >"$out/profile.log" 2>&1); echo "profile rc=$?"; tail -25 "$out/profile.log" ;;
    bench) (cd benchmarks && timeout 560 python3 gpu_decode.py --out "$out/gpu_h200.json" ${BENCH_ARGS:-} \
             >"$out/bench.log" 2>&1); echo "bench rc=$?"; tail -12 "$out/bench.log" ;;
  esac
done
