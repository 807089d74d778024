#!/usr/bin/env bash
# ftar_waves_bench.sh — the cross-host part of a bucketed all-reduce
# overlapped with its producer (waves of whole buckets, core/ftar/ftar_hier.c;
# WAVE_MIN floats at least, default the product's) against one wave
# (TRANSOM_FTAR_WAVE_MIN=0: the leaders' ring, or the grid's columns, after
# the last bucket), on test hosts, in the same run.
#
# The test bed: H test hosts (network namespaces, spec/hosts/testhosts.sh),
# links limited with tc tbf to RATE, RANKS_PER_HOST ranks on each
# (2: the hierarchy; 1 on an even H >= 4: the grid). Each rank runs
# `transom ftar-bench rank --bucket B --produce-us U`: it starts the
# all-reduce, then writes its input from the end half a bucket at a time,
# pausing U us after each half (backward producing gradients), then waits.
# Per call: the time from start to result (the slowest rank), the
# producer's time (its pauses, n/(B/2) * U: the same for both variants; the
# copies beside them are small) and the exposed part: call - producer. Both
# variants run REPEAT times interleaved; the best per size counts. Prints
# the ratio of exposed times (one wave / waves) and of call times.
#
#   bench/ftar_waves_bench.sh
#   HOSTS=2 RANKS_PER_HOST=2 SIZES=4M,16M BUCKET_MB=1 PRODUCE_US=2000 RATE=1gbit REPEAT=3 WAVE_MIN=
#   HOSTS=4 RANKS_PER_HOST=1 bench/ftar_waves_bench.sh       (the grid)
#
# Needs root (namespaces); exit 77 when namespaces cannot be made.
set -euo pipefail
cd "$(dirname "$0")/.."
PATH=/usr/sbin:/sbin:$PATH

HOSTS=${HOSTS:-2}
RPH=${RANKS_PER_HOST:-2}
SIZES=${SIZES:-4M,16M}
BUCKET_MB=${BUCKET_MB:-1}
PRODUCE_US=${PRODUCE_US:-2000}
WAVE_MIN=${WAVE_MIN:-}
RATE=${RATE:-1gbit}
REPEAT=${REPEAT:-3}
ITERS=${ITERS:-8}
NET=${NET:-10.84.0}
BUILD=${BUILD:-build}
TH=spec/hosts/testhosts.sh
NAME=fwb$(($$ % 1000000))

die() { echo "ftar_waves_bench: $*" >&2; exit 1; }
[[ $HOSTS =~ ^[0-9]+$ ]] && [ "$HOSTS" -ge 2 ] && [ "$HOSTS" -le 16 ] || die "HOSTS must be 2..16: $HOSTS"
[[ $RPH =~ ^[1-9]$ ]] || die "RANKS_PER_HOST must be 1..9: $RPH"
[[ $SIZES =~ ^[0-9]+[KM]?(,[0-9]+[KM]?)*$ ]] || die "SIZES must be a list like 4M,16M: $SIZES"
[[ $PRODUCE_US =~ ^[0-9]+$ ]] || die "PRODUCE_US must be an integer: $PRODUCE_US"
[[ $REPEAT =~ ^[1-9][0-9]*$ ]] || die "REPEAT must be >= 1: $REPEAT"
[[ $ITERS =~ ^[1-9][0-9]*$ ]] || die "ITERS must be >= 1: $ITERS"
[[ $WAVE_MIN =~ ^[0-9]*$ ]] || die "WAVE_MIN must be floats (an integer) or empty: $WAVE_MIN"
BUCKET=$(awk -v mb="$BUCKET_MB" 'BEGIN { b = int(mb * 1048576 / 4); if (b < 1) exit 1; print b }') ||
  die "BUCKET_MB must be > 0: $BUCKET_MB"

TMP=$(mktemp -d /tmp/ftar_waves_bench.XXXXXX)
cleanup() {
  local rc=$? p
  trap - EXIT INT TERM
  for p in $(jobs -pr); do kill -9 "$p" 2>/dev/null || true; done
  $TH down "$NAME" >/dev/null 2>&1 || echo "ftar_waves_bench: could not delete every namespace of $NAME" >&2
  rm -rf "$TMP"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

$TH probe >/dev/null || { echo "ftar_waves_bench: cannot make network namespaces here"; exit 77; }
if [ ! -x "$BUILD/transom" ]; then
  cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release >/dev/null || die "cmake configure failed"
  nice cmake --build "$BUILD" -j2 --target transom >/dev/null || die "building transom failed"
fi
BIN=$(realpath "$BUILD/transom")
$TH up "$NAME" "$HOSTS" "$NET" >/dev/null || die "testhosts.sh up $NAME $HOSTS $NET failed"
for k in $(seq 1 "$HOSTS"); do
  $TH reach "$NAME" 1 "$NET.$k" || die "host 1 does not reach $NET.$k"
  if [ "$RATE" != none ]; then $TH slow "$NAME" "$k" "$RATE" >/dev/null || die "tc tbf $RATE on host $k failed"; fi
done

N=$((HOSTS * RPH))
# one run: waves (0: one wave, 1: waves) size_bytes -> "us_per_call"
one_run() {
  local waves=$1 bytes=$2 count=$(($2 / 4)) s k out=$TMP/coord.out fifo=$TMP/coord.in port="" pids=() wm=0
  [ "$waves" = 1 ] && wm=$WAVE_MIN
  : >"$out"
  [ -p "$fifo" ] || mkfifo "$fifo"
  ip netns exec "$NAME-h1" "$BIN" ftar-bench coord --host "$NET.1" --port 0 --deadline 3 <>"$fifo" >"$out" 2>&1 &
  local cpid=$!
  for _ in $(seq 1 100); do
    port=$(sed -n 's/^ftar-coord port=\([0-9]*\).*/\1/p' "$out")
    [ -n "$port" ] && break
    sleep 0.1
  done
  [ -n "$port" ] || die "the coordinator did not start: $(tail -3 "$out")"
  for ((s = 0; s < N; s++)); do
    k=$((s / RPH + 1))
    TRANSOM_FTAR_WAVE_MIN=$wm timeout -k 5 300 ip netns exec "$NAME-h$k" "$BIN" ftar-bench rank \
      --coord "$NET.1:$port" --host "$NET.$k" --slot $s --wait $N --counts $count --iters "$ITERS" --warmup 1 \
      --quiet --verify --bucket "$BUCKET" --produce-us "$PRODUCE_US" >"$TMP/rank.$s" 2>&1 &
    pids+=($!)
  done
  local fail=0
  for p in "${pids[@]}"; do wait "$p" || fail=1; done
  kill -TERM "$cpid" 2>/dev/null || true
  wait "$cpid" 2>/dev/null || true
  [ $fail = 0 ] || die "a rank failed (waves=$waves, $bytes bytes): $(tail -2 "$TMP"/rank.* | head -20)"
  grep -h '^ftar-hier' "$TMP"/rank.* | head -1 >"$TMP/hier.$waves" || true
  awk '/^ftar-time/ { for (i = 2; i <= NF; i++) { split($i, kv, "="); f[kv[1]] = kv[2] }
                      t = f["sec"] / f["iters"]; if (t > worst) worst = t }
       END { if (worst <= 0) exit 1; printf "%.1f\n", worst * 1e6 }' "$TMP"/rank.* ||
    die "no ftar-time lines (waves=$waves)"
}

echo "FTAR waves across $HOSTS test hosts x $RPH ranks | tbf $RATE | bucket $BUCKET_MB MiB, waves of ${WAVE_MIN:-the default} floats at least, producer pause $PRODUCE_US us a half bucket | best of $REPEAT interleaved | $(nproc) CPUs"
echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
for size in ${SIZES//,/ }; do
  bytes=$(echo "$size" | awk '{ x = $1; m = 1; if (x ~ /K$/) m = 1024; else if (x ~ /M$/) m = 1048576; sub(/[KM]$/, "", x); print x * m }')
  for r in $(seq "$REPEAT"); do
    for w in 0 1; do
      # not in $(...): there `die` would end only the subshell (and errexit
      # is off), leaving an empty time in the table and the coordinator running
      one_run $w "$bytes" >"$TMP/t"
      echo "$size $w $(cat "$TMP/t")" >>"$TMP/times"
    done
  done
done
echo "shape (waves=1 run): $(sed 's/ftar-hier //' "$TMP/hier.1")"
awk -v bucket="$BUCKET" -v pu="$PRODUCE_US" '
  function human(b) { if (b >= 1048576) return (b / 1048576) " MiB"; return (b / 1024) " KiB" }
  { if (!($1 in seen)) { seen[$1] = 1; order[++no] = $1 }
    if (!(($1, $2) in best) || $3 < best[$1, $2]) best[$1, $2] = $3 }
  END {
    printf "%8s %12s %14s %12s %14s %12s %12s\n", "size", "producer us", "one wave us", "exposed", "waves us", "exposed", "exposed 1/w"
    for (i = 1; i <= no; i++) {
      s = order[i]; x = s; m = 1; if (x ~ /K$/) m = 1024; else if (x ~ /M$/) m = 1048576; sub(/[KM]$/, "", x)
      count = x * m / 4; halves = int((count + bucket / 2 - 1) / (bucket / 2)); prod = halves * pu
      a = best[s, 0]; b = best[s, 1]; ea = a - prod; eb = b - prod
      printf "%8s %12.0f %14.0f %12.0f %14.0f %12.0f %11s\n", s, prod, a, ea, b, eb, (eb > 0 ? sprintf("%.2fx", ea / eb) : "-")
    }
  }' "$TMP/times"
echo "call time one wave / waves: $(awk '{ if (!(($1, $2) in b) || $3 < b[$1, $2]) b[$1, $2] = $3; s[$1] = 1 } END { for (k in s) printf "%s %.2fx  ", k, b[k, 0] / b[k, 1] }' "$TMP/times")"
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
