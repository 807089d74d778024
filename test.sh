#!/usr/bin/env bash
# test.sh — the whole test suite: set-up, a release build with the C tests
# and every Lua spec (ctest; the C tests one at a time, then the spec files
# four at a time), then the sanitizer passes side by side, four jobs at a
# time: the C tests and the Lua specs again under AddressSanitizer +
# UndefinedBehaviorSanitizer (the multi-process specs less 10 cases, timing
# stretched), the threaded C tests (FTAR, the checkpoint engine, the
# detector, the policy engine) and a short multi-replica job under
# ThreadSanitizer, and each libFuzzer target for 10 s (spec/fuzz/run.sh;
# skipped without clang).
#
#   ./test.sh           everything (what CI runs)
#   ./test.sh --quick   release build only, no sanitizer or fuzz pass
#   ./test.sh --long    also the long soak scenarios (TRANSOM_LONG=1)
#
# TRANSOM_JOBS=N builds with N jobs (default: every core).
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
jobs=${TRANSOM_JOBS:-$(nproc)}
detector/test_deps.sh   # gnuplot (transom plot) and promtool (the /metrics check)
spec/hosts/deps.sh || echo "=== slurm-wlm/munge not installed: spec/slurm_spec.lua will skip"
# clang with libFuzzer, for the fuzz targets at the end (built beside the tests below)
have_fuzz=0
if [ "$quick" = 0 ]; then
  spec/fuzz/deps.sh || echo "=== fuzz targets: could not install clang (spec/fuzz/deps.sh failed)"
  if command -v clang >/dev/null 2>&1 &&
    echo 'int LLVMFuzzerTestOneInput(const char *d, unsigned long n) { (void)d; (void)n; return 0; }' |
    clang -x c -fsanitize=fuzzer -o /dev/null - >/dev/null 2>&1; then
    have_fuzz=1
  fi
fi
export TRANSOM_REQUIRE_PROMTOOL=1 TRANSOM_REQUIRE_GNUPLOT=1

# Python with safetensors + numpy, for the export test (from the package index)
if ! build/pyvenv/bin/python -c 'import safetensors, numpy' 2>/dev/null; then
  python3 -m venv build/pyvenv
  build/pyvenv/bin/pip install -q safetensors numpy
fi
export TRANSOM_PYTHON=$PWD/build/pyvenv/bin/python TRANSOM_REQUIRE_PYTHON=1

# Python with torch + transformers, for the Hugging Face round trip
# (spec/hf_spec.lua), from PyPI. PyPI's Linux torch is the CUDA build and
# does not import without its CUDA libraries (--no-deps: "libcufile.so.0:
# cannot open shared object file"), so they come too: about 5.6 GB. So it
# lives outside the checkout, in the user's cache (TRANSOM_HF_VENV, default
# ~/.cache/transom/hfvenv), made once per machine rather than once per
# clone. TRANSOM_NO_HF=1 skips it (the spec is then pending).
hf_venv=${TRANSOM_HF_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/transom/hfvenv}
if [ -z "${TRANSOM_NO_HF:-}" ]; then
  if ! "$hf_venv/bin/python" -c 'import torch, transformers' 2>/dev/null; then
    mkdir -p "$(dirname "$hf_venv")"
    python3 -m venv "$hf_venv"
    "$hf_venv/bin/pip" install -q torch transformers ||
      echo "test.sh: installing torch + transformers failed: the Hugging Face round trip will be pending"
  fi
  if "$hf_venv/bin/python" -c 'import torch, transformers' 2>/dev/null; then
    export TRANSOM_HF_PYTHON=$hf_venv/bin/python TRANSOM_REQUIRE_HF=1
  fi
fi

if [ -f build/libtransom_cuda.so ]; then
  echo "=== CUDA backend: built (build/libtransom_cuda.so); its tests run on a GPU and skip without one"
else
  echo "=== CUDA backend: not built (no nvcc found, or TRANSOM_CUDA=OFF)"
fi
# pool N JOB...: runs the jobs (each a command line, word-split) N at a time
# in the order given (the longest first), each one's output to a file of its
# own, printed whole under its name and time as it ends; 1 if any failed,
# named again at the end. Each job writes its own exit status (bash forgets
# a job that a signal ended once it has said so; its status is then "none").
pool() {
  local n=$1 dir pid k r failed=() i=0; shift
  local -A job_of=() start_of=()
  dir=$(mktemp -d)
  while [ "$i" -lt "$#" ] || [ "${#job_of[@]}" -gt 0 ]; do
    if [ "$i" -lt "$#" ] && [ "${#job_of[@]}" -lt "$n" ]; then
      i=$((i + 1))
      (r=0; ${!i} || r=$?; echo "$r" >"$dir/$i.rc") >"$dir/$i" 2>&1 &
      job_of[$!]=$i start_of[$!]=$SECONDS
      continue
    fi
    # (a job exits 0 unless a signal ended it; 127: none of them is ours any more)
    wait -n "${!job_of[@]}" 2>/dev/null || { [ $? != 127 ] || sleep 0.5; }
    for pid in "${!job_of[@]}"; do
      ! kill -0 "$pid" 2>/dev/null || continue
      k=${job_of[$pid]}
      r=$(cat "$dir/$k.rc" 2>/dev/null || echo none)
      echo "--- ${!k} ($((SECONDS - start_of[$pid])) s$([ "$r" = 0 ] || echo ", FAILED: exit status $r"))"
      cat "$dir/$k"
      [ "$r" = 0 ] || failed+=("${!k}")
      unset "job_of[$pid]" "start_of[$pid]"
    done
  done
  rm -rf "$dir"
  [ "${#failed[@]}" = 0 ] || { printf '=== failed: %s\n' "${failed[@]}" >&2; return 1; }
}

# The sanitizer builds (ASan + UBSan, then ThreadSanitizer, then the fuzz
# targets) start now, at nice 19, beside the release tests: they take the
# cores' idle time (the C tests leave ~60% of it, the specs ~10%) and
# hardly any from the tests (a nice-19 process gets ~1.5% of a core a
# nice-0 one wants, and gives it up when one wakes). Each build
# writes its output and then its exit status under san_log, shown when its
# pass needs it (san_build). They run in a process group of their own,
# killed if test.sh ends first (a failed test, Ctrl-C).
tsan_tests=(test_ftar test_ftar_dev test_ckpt test_detector test_policy)
if [ "$quick" = 0 ]; then
  san_log=$(mktemp -d)
  # san_step NAME CMD...: runs CMD into san_log/NAME, then writes NAME.rc whole
  san_step() {
    local name=$1 r=0; shift
    "$@" >"$san_log/$name" 2>&1 </dev/null || r=$?
    echo "$r" >"$san_log/$name.rc.tmp" && mv "$san_log/$name.rc.tmp" "$san_log/$name.rc"
  }
  san_asan() {
    # the CUDA plugin is compiled (and its GPU tests run or skip) in the release build
    cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTRANSOM_SANITIZE=ON -DTRANSOM_CUDA=OFF >/dev/null &&
      cmake --build build-asan -j"$jobs"
  }
  san_tsan() {
    cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTRANSOM_SANITIZE=thread -DTRANSOM_CUDA=OFF >/dev/null &&
      cmake --build build-tsan -j"$jobs" --target transom "${tsan_tests[@]}"
  }
  set -m # the builds get a process group of their own
  (
    renice -n 19 -p "$BASHPID" >/dev/null || true
    san_step asan san_asan
    san_step tsan san_tsan
    [ "$have_fuzz" = 0 ] || san_step fuzz env JOBS="$jobs" spec/fuzz/run.sh build
  ) &
  san_pid=$!
  set +m
  trap 'kill -- -"$san_pid" 2>/dev/null || true; rm -rf "$san_log"' EXIT
fi
# san_build asan|tsan|fuzz: waits (bounded: 1 h) for that background build,
# shows its output, and returns 1 if it failed
san_build() {
  for _ in $(seq 3600); do
    [ -f "$san_log/$1.rc" ] || ! kill -0 "$san_pid" 2>/dev/null && break
    sleep 1
  done
  [ -f "$san_log/$1.rc" ] || { echo "=== the $1 build did not end (within an hour)" >&2; return 1; }
  cat "$san_log/$1"
  [ "$(cat "$san_log/$1.rc")" = 0 ] || { echo "=== the $1 build failed (above)" >&2; return 1; }
}

echo "=== release build: the C tests one at a time, then the Lua specs four at a time"
(cd build && rc=0 && { ctest --output-on-failure -j1 -E '^spec_' || rc=1; } &&
  { ctest --output-on-failure -j4 -R '^spec_' || rc=1; } && exit $rc)

if [ "$quick" = 0 ]; then
  # The sanitizer passes, one pool (four jobs at a time, the longest first):
  # the C tests under ASan + UBSan, the Lua specs under it (file by file),
  # the ThreadSanitizer pass and the fuzz targets. Each C-test pass leaves a
  # core idle about half its time (its ranks wait on each other and on the
  # deadlines of its fault cases), and the specs wait on the jobs' clocks:
  # one after the other these passes took ~15 min on 2 cores, side by side
  # ~11.5 with the cores busy. So the C tests here run beside others, at time
  # scale 3 like the specs (test_ftar, test_ftar_dev and test_util read
  # TRANSOM_TIME_SCALE: it stretches a test's own waits and the slack of its
  # latency bounds, never a deadline it gives the product; the other C
  # tests' few wall-clock bounds are seconds wide); the release build above
  # runs them alone at scale 1, where those bounds are checked tight.
  echo "=== sanitizer passes (built beside the release tests): ASan + UBSan C tests and Lua specs, ThreadSanitizer, fuzz targets; four at a time"
  san_build asan || exit 1
  san_build tsan || exit 1
  [ "$have_fuzz" = 0 ] || san_build fuzz || exit 1
  # asan_env: the sanitizer options for a job of the ASan build (each pool
  # job runs in a subshell of its own, so they stay there)
  asan_env() {
    export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
    export LSAN_OPTIONS=suppressions=$PWD/spec/lsan.supp:print_suppressions=0
  }
  asan_ctests() {
    asan_env
    cd build-asan && TRANSOM_TIME_SCALE=3 ctest --output-on-failure -j1 -E '^spec_'
  }
  # The multi-process fault scenarios (operator, Eagle Eye, attach, REPL):
  # every process they spawn is the ASan binary, so a leak or a
  # use-after-free in a worker, the operator or the donor fails them.
  # TRANSOM_TIME_SCALE=3 stretches the specs' own waits and the thresholds
  # they set (deadline, hang_seconds, HANG_T/DEAD_T) for the slowdown
  # (spec/support.lua); the product's defaults stay. All their cases pass
  # so but take too long on 2 cores for CI: the 10 left out go through code
  # another case here already takes (two killed at once and the chaos
  # list's kill: the replace and join of the kill -9 case; restart_all:
  # every replica restarted from the checkpoint, as after all are killed;
  # the operator killed before its first checkpoint: the resume of SIGTERM
  # + --resume; checkpoint.every_seconds: a timing rule; the clean 500-step
  # run: every run's clean stretch; SIGSTOP: the hang case's eviction and
  # replacement; a policy saved broken: the reloads of test_policy and
  # test_detector, under ASan too; the buckets' bit identity: two clean
  # runs, the code of the bucket kill case; the lead's STOP after the
  # wind-down: the wait for a STOP of the case whose STOP is lost). The
  # others (the soak is pending without --long) run here. The specs that
  # run in one process or a few short ones run whole, at time scale 1.
  asan_skip=("two workers killed at once" "chaos list kills a replica" "restart_all"
    "killed before its first checkpoint" "every_seconds" "a clean 500" "SIGSTOP: dead" "a policy saved broken"
    "in buckets while backward runs" "the lead's STOP after the wind")
  asan_bin=$PWD/build-asan/transom
  # asan_spec NAME [scaled]: spec/NAME_spec.lua under the ASan binary; scaled:
  # at time scale 3, without the cases above
  asan_spec() {
    asan_env
    if [ "${2:-}" = scaled ]; then
      TRANSOM_TIME_SCALE=3 TRANSOM_BIN=$asan_bin "$asan_bin" test "${asan_skip[@]/#/--filter-out=}" "spec/$1_spec.lua"
    else
      TRANSOM_BIN=$asan_bin "$asan_bin" test "spec/$1_spec.lua"
    fi
  }
  # tsan_pass: FTAR, the checkpoint engine, the detector and the policy
  # engine's C tests, then a short fleet job, under ThreadSanitizer. Every
  # report of every process (test_ftar's ranks, the forked members and
  # writers) lands in its own file under its log folder: any file fails
  # the pass, with its contents. No suppressions: no report so far came
  # from a library. OMP_NUM_THREADS=1: libgomp is not instrumented, its
  # barriers would read as races (these tests hardly use OpenMP anyway).
  # TRANSOM_TEST_SMALL: thread interactions, not throughput, are what this
  # pass checks (spec/c/check.h).
  tsan_pass() {
    local log rc=0 corpus=$PWD/../shared/data/tinyshakespeare.txt
    log=$(mktemp -d)
    export TSAN_OPTIONS="log_path=$log/tsan second_deadlock_stack=1" OMP_NUM_THREADS=1
    (cd build-tsan && TRANSOM_TEST_SMALL=1 TRANSOM_TIME_SCALE=3 \
      ctest --output-on-failure -j1 -R "^($(IFS='|'; echo "${tsan_tests[*]}"))\$") || rc=1
    # The fleet's threads (a worker's heartbeat and donor, FTAR's control
    # thread, the checkpoint engine's copier and writer) run in no C test:
    # a short 2-replica job where the chaos list kills replica 1 at step 30
    # and its replacement catches up from a donor (about 20 s); gradients go
    # in small buckets, so FTAR's communication thread reduces them while
    # the training thread's backward writes the rest.
    if [ -f "$corpus" ]; then
      cat > "$log/job.lua" <<EOF
return { data = "$corpus", replicas = 2, max_steps = 80, warmup_steps = 10, n_layer = 2, n_head = 2, n_embd = 64,
  block_size = 32, batch_size = 8, eval_interval = 0, eval_steps = 5, sample_tokens = 0, log_interval = 20,
  checkpoint = { every_steps = 10 }, checksum_interval = 10, chaos = { { at_step = 30, replica = 1, fault = "kill" } },
  bucket_mb = 0.05 }
EOF
      build-tsan/transom run "$log/job.lua" --set run_dir="$log/run" >"$log/run.log" 2>&1 ||
        { tail -20 "$log/run.log"; rc=1; }
      grep -q "catches up from replica" "$log/run/events.jsonl" 2>/dev/null ||
        echo "(the TSan job's replacement did not catch up from a donor: the donor's serving went unchecked)"
    else
      echo "(no $corpus: the TSan fleet job is skipped)"
    fi
    if compgen -G "$log/tsan.*" >/dev/null; then
      cat "$log"/tsan.*
      echo "=== ThreadSanitizer reported the above"
      rc=1
    fi
    rm -rf "$log"
    return $rc
  }
  # the readers of untrusted bytes under libFuzzer (spec/fuzz/), 10 s each,
  # one at a time here
  fuzz_pass() { JOBS=1 spec/fuzz/run.sh 10; }
  fuzz_job=()
  [ "$have_fuzz" = 0 ] || fuzz_job=(fuzz_pass)
  pool 4 "asan_spec operator_stop scaled" "asan_spec operator scaled" tsan_pass "asan_spec pipeline" \
    asan_ctests "asan_spec attach scaled" "asan_spec hf" "asan_spec eagle scaled" "asan_spec ckpt" \
    "asan_spec device" "${fuzz_job[@]}" "asan_spec e2e" "asan_spec job" "asan_spec data" "asan_spec repl scaled" \
    "asan_spec detector" "asan_spec graph" || { echo "=== a sanitizer pass failed (above)" >&2; exit 1; }
  [ "$have_fuzz" = 1 ] ||
    echo "=== fuzz targets: SKIPPED (no clang with libFuzzer; spec/fuzz/deps.sh installs clang libclang-rt-dev libomp-dev)"
fi
echo "=== all tests passed"
