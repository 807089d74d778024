#!/usr/bin/env bash
# run.sh — builds the libFuzzer targets (in build-fuzz/, with clang) if
# needed and runs each for SECONDS over a scratch copy of its seed corpus
# (spec/fuzz/corpus/<target>/, never written to), one target per core at a
# time. Prints, per target, the inputs executed and the crashes found;
# exits non-zero on any crash, with the crashing input kept under
# build-fuzz/crashes/<target>/ (reproduce: build-fuzz/fuzz_<target> FILE).
# test.sh runs it for 10 s a target.
#
#   spec/fuzz/run.sh [SECONDS] [TARGET...]   default 10 s; every target
#   spec/fuzz/run.sh build                   only build them
#   JOBS=N spec/fuzz/run.sh ...              build jobs and targets at a time (default nproc)
#
# Targets: ftar_frame proto job safetensors ckpt_manifest json_top (fuzz_<target>.c
# says what each one fuzzes and checks).
set -euo pipefail
cd "$(dirname "$0")/../.."

build_only=0
[ "${1:-}" = build ] && build_only=1 && shift
secs=${1:-10}
[ $# -gt 0 ] && shift
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(ftar_frame proto job safetensors ckpt_manifest json_top)
case "$secs" in '' | *[!0-9]*) echo "run.sh: SECONDS must be a whole number, not '$secs'" >&2; exit 2 ;; esac

if ! command -v clang >/dev/null 2>&1; then
  echo "run.sh: clang not found (spec/fuzz/deps.sh installs it)" >&2
  exit 2
fi
if [ ! -f build-fuzz/CMakeCache.txt ]; then
  CC=clang cmake -S . -B build-fuzz -DTRANSOM_FUZZ=ON -DTRANSOM_CUDA=OFF -DTRANSOM_NATIVE=OFF >/dev/null
fi
cmake --build build-fuzz --target fuzz -j"${JOBS:-$(nproc)}" >/dev/null
[ "$build_only" = 0 ] || exit 0

# Per target: the longest input (the longest frame or line, with room) and
# the largest single allocation allowed (job: the harness caps Lua at 256 MiB).
max_len() { case "$1" in ftar_frame) echo 20000 ;; proto) echo 12288 ;; *) echo 4096 ;; esac; }
malloc_mb() { case "$1" in job) echo 512 ;; *) echo 64 ;; esac; }

base=/tmp
[ -d /dev/shm ] && [ -w /dev/shm ] && base=/dev/shm # scratch files per input: keep them off the disk
work=$(mktemp -d "$base/transom-fuzz.XXXXXX")
trap 'rm -rf "$work"' EXIT
export LSAN_OPTIONS=${LSAN_OPTIONS:-suppressions=$PWD/spec/lsan.supp:print_suppressions=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}

# fuzz_one TARGET: runs it and prints its line (and, on a crash, its log);
# marks a failure with $work/TARGET.failed, its end with $work/TARGET.done
# (a run that stopped short of it fails too)
fuzz_one() {
  local t=$1 bin=build-fuzz/fuzz_$1 rc=0 dict=() runs crashes
  mkdir -p "$work/$t/tmp" "$work/$t/artifacts"
  cp -r "spec/fuzz/corpus/$t" "$work/$t/corpus"
  [ -f "spec/fuzz/$t.dict" ] && dict=(-dict="spec/fuzz/$t.dict")
  TMPDIR=$work/$t/tmp "$bin" "$work/$t/corpus" "${dict[@]}" -max_total_time="$secs" -timeout=20 \
    -max_len="$(max_len "$t")" -malloc_limit_mb="$(malloc_mb "$t")" -rss_limit_mb=2048 \
    -artifact_prefix="$work/$t/artifacts/" -print_final_stats=1 >"$work/$t/log" 2>&1 || rc=$?
  runs=$(awk '/stat::number_of_executed_units/ {print $2}' "$work/$t/log")
  crashes=$(find "$work/$t/artifacts" -type f | wc -l)
  if [ "$rc" -ne 0 ] || [ "$crashes" -ne 0 ]; then
    touch "$work/$t.failed"
    mkdir -p "build-fuzz/crashes/$t"
    find "$work/$t/artifacts" -type f -exec cp {} "build-fuzz/crashes/$t/" \;
    echo "$t: ${runs:-?} runs in ${secs} s, $((crashes > 0 ? crashes : 1)) crash(es) (exit $rc); kept in build-fuzz/crashes/$t/:"
    grep -v '^INFO:\|^#[0-9]' "$work/$t/log" | tail -40 | sed 's/^/  /' || true
  else
    echo "$t: ${runs:-?} runs in ${secs} s, 0 crashes"
  fi
  touch "$work/$t.done"
}

# One target per core at a time (each fuzzer is one process on one core;
# JOBS caps it), their lines printed in the targets' order once all have run.
for t in "${targets[@]}"; do
  [ -x "build-fuzz/fuzz_$t" ] || { echo "run.sh: no target '$t' (build-fuzz/fuzz_$t)" >&2; exit 2; }
done
for t in "${targets[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "${JOBS:-$(nproc)}" ]; do wait -n || true; done
  fuzz_one "$t" >"$work/$t.report" 2>&1 &
done
wait
failed=0
for t in "${targets[@]}"; do
  cat "$work/$t.report"
  [ ! -f "$work/$t.failed" ] && [ -f "$work/$t.done" ] || { failed=1; [ -f "$work/$t.done" ] || echo "$t: its run stopped short"; }
done
exit $failed
