#!/usr/bin/env bash
# attention_bench.sh — causal attention on the CPU by panels of query rows
# (core/tensor/kernels.c: the matmuls skip the masked keys) against the
# whole (T,T) products (TRANSOM_TEST_ATTN_PANEL_ROWS=0), in the same script:
# the Shakespeare model's shapes at block sizes 64, 256 and 1024, per-op
# times from TRANSOM_PROFILE, best of REPEAT interleaved runs. Prints the
# attention op's forward and backward µs a call and the step's ms, and their
# ratios whole/panels (> 1: the panels are faster). No thresholds.
# BASE=path/to/transom adds that build (an older commit) as a third column,
# and its ratio to the panels (the softmax's vectorized exp shows there).
#
#   bench/attention_bench.sh            REPEAT=3 STEPS=20 [BASE=...]
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${TRANSOM:-build/transom}
DATA=${1:-../shared/data/tinyshakespeare.txt}
REPEAT=${REPEAT:-3}
STEPS=${STEPS:-20}
[ -x "$BIN" ] || { echo "attention_bench: no $BIN (build first)" >&2; exit 2; }
[ -f "$DATA" ] || { echo "attention_bench: no corpus at $DATA" >&2; exit 2; }
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

# one run: "fwd_us bwd_us ms_step" of the attention op
one() { # T B panel_rows [binary]
  TRANSOM_PROFILE=1 TRANSOM_TEST_ATTN_PANEL_ROWS=$3 "${4:-$BIN}" run examples/shakespeare.lua --set data="$DATA" \
    --set block_size="$1" --set batch_size="$2" --set max_steps="$STEPS" --set eval_interval=0 --set sample_tokens=0 \
    --set checkpoint.every_steps=0 --set checkpoint.every_seconds=0 --set run_dir="$TMP/run" 2>&1 |
    awk '/attention +forward/ {f = $6} /attention +backward/ {b = $6} /^done:/ {s = $5} END {print f, b, s}'
  rm -rf "$TMP/run"
}

echo "causal attention, CPU: panels of query rows vs the whole products | $(nproc) CPUs | best of $REPEAT interleaved | load $(cut -d' ' -f1-3 /proc/loadavg)"
printf "%6s %4s | %22s | %22s | %17s\n" T B "attn fwd us whole/pan" "attn bwd us whole/pan" "step ms whole/pan"
for tb in "64 12" "256 4" "1024 1"; do
  set -- $tb
  for r in $(seq "$REPEAT"); do
    one "$1" "$2" 0 >>"$TMP/whole.$1"
    one "$1" "$2" "" >>"$TMP/panels.$1"
    if [ -n "${BASE:-}" ]; then one "$1" "$2" "" "$BASE" >>"$TMP/base.$1"; fi
  done
  paste <(sort -n -k3 "$TMP/whole.$1" | head -1) <(sort -n -k3 "$TMP/panels.$1" | head -1) |
    awk -v T="$1" -v B="$2" '{ printf "%6d %4d | %7.0f %6.0f %6.2fx | %7.0f %6.0f %6.2fx | %5.1f %5.1f %5.2fx\n",
      T, B, $1, $4, $1 / $4, $2, $5, $2 / $5, $3, $6, $3 / $6 }'
  if [ -n "${BASE:-}" ]; then
    paste <(sort -n -k3 "$TMP/base.$1" | head -1) <(sort -n -k3 "$TMP/panels.$1" | head -1) |
      awk '{ printf "%11s | %7.0f %6.0f %6.2fx | %7.0f %6.0f %6.2fx | %5.1f %5.1f %5.2fx\n",
        "BASE/pan", $1, $4, $1 / $4, $2, $5, $2 / $5, $3, $6, $3 / $6 }'
  fi
done
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
