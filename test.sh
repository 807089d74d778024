#!/usr/bin/env bash
# test.sh — the whole test suite: set-up, a release build with the C tests
# and every Lua spec (ctest), then the C tests and the single-process Lua
# specs again under AddressSanitizer + UndefinedBehaviorSanitizer, then each
# libFuzzer target for 10 s (spec/fuzz/run.sh; skipped without clang).
#
#   ./test.sh           everything (what CI runs)
#   ./test.sh --quick   release build only, no sanitizer or fuzz pass
#   ./test.sh --long    also the long soak scenarios (TRANSOM_LONG=1)
set -euo pipefail
cd "$(dirname "$0")"

quick=0
for a in "$@"; do
  case "$a" in
    --quick) quick=1 ;;
    --long) export TRANSOM_LONG=1 ;;
    *) echo "test.sh: unknown option $a" >&2; exit 2 ;;
  esac
done

./setup.sh
jobs=$(nproc)
detector/test_deps.sh   # gnuplot (transom plot) and promtool (the /metrics check)
export TRANSOM_REQUIRE_PROMTOOL=1 TRANSOM_REQUIRE_GNUPLOT=1

# Python with safetensors + numpy, for the export test (from the package index)
if ! build/pyvenv/bin/python -c 'import safetensors, numpy' 2>/dev/null; then
  python3 -m venv build/pyvenv
  build/pyvenv/bin/pip install -q safetensors numpy
fi
export TRANSOM_PYTHON=$PWD/build/pyvenv/bin/python TRANSOM_REQUIRE_PYTHON=1

if [ -f build/libtransom_cuda.so ]; then
  echo "=== CUDA backend: built (build/libtransom_cuda.so); its tests run on a GPU and skip without one"
else
  echo "=== CUDA backend: not built (no nvcc found, or TRANSOM_CUDA=OFF)"
fi
echo "=== release build: C tests + Lua specs"
(cd build && ctest --output-on-failure -j1)

if [ "$quick" = 0 ]; then
  echo "=== sanitizer build (ASan + UBSan)"
  # the CUDA plugin is compiled (and its GPU tests run or skip) in the release build
  cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTRANSOM_SANITIZE=ON -DTRANSOM_CUDA=OFF >/dev/null
  cmake --build build-asan -j"$jobs"
  export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
  export LSAN_OPTIONS=suppressions=$PWD/spec/lsan.supp:print_suppressions=0
  # the C tests, and the Lua specs that run in one process or a few short
  # ones; the multi-process fault scenarios (operator, Eagle Eye, attach)
  # ran above: under the sanitizers' slowdown they would test timing, not code
  (cd build-asan && ctest --output-on-failure -j1 -E lua_specs)
  TRANSOM_BIN=$PWD/build-asan/transom build-asan/transom test spec/job_spec.lua spec/graph_spec.lua \
    spec/e2e_spec.lua spec/ckpt_spec.lua spec/detector_spec.lua spec/device_spec.lua

  # the readers of untrusted bytes under libFuzzer (spec/fuzz/), 10 s each
  spec/fuzz/deps.sh || echo "=== fuzz targets: could not install clang (spec/fuzz/deps.sh failed)"
  if command -v clang >/dev/null 2>&1 &&
    echo 'int LLVMFuzzerTestOneInput(const char *d, unsigned long n) { (void)d; (void)n; return 0; }' |
    clang -x c -fsanitize=fuzzer -o /dev/null - >/dev/null 2>&1; then
    echo "=== fuzz targets (libFuzzer + ASan + UBSan, 10 s each)"
    JOBS=$jobs spec/fuzz/run.sh 10
  else
    echo "=== fuzz targets: SKIPPED (no clang with libFuzzer; spec/fuzz/deps.sh installs clang libclang-rt-dev libomp-dev)"
  fi
fi
echo "=== all tests passed"
