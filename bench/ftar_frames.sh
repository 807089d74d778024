#!/usr/bin/env bash
# ftar_frames.sh — FTAR's largest frame (ftar_member_opts.chunk_bytes) against
# a baseline frame size, in the same run: busbw of `transom ftar-bench` with
# each candidate --chunk, TCP (--tcp: a host per rank, so 4 ranks take the
# grid) and shared memory, 2 and 4 ranks. Runs are interleaved and the best
# per size kept (a shared machine's load moves every number). Prints busbw
# per candidate and its ratio to the baseline; the default is the chunk the
# ratios favoured (128 KiB against 256 KiB: smaller frames let each step's
# next hop start sooner, where 4 ranks share 2 cores and every step hands
# the core over).
#
#   bench/ftar_frames.sh
#   BASE=262144 CHUNKS="131072 65536" RANKS="4" SIZES=4M,16M REPEAT=5 bench/ftar_frames.sh
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD=${BUILD:-build}
SIZES=${SIZES:-64K,256K,1M,4M,16M,64M}
RANKS=${RANKS:-"2 4"}
REPEAT=${REPEAT:-3}
BASE=${BASE:-262144}
CHUNKS=${CHUNKS:-131072}
if [ ! -x "$BUILD/transom" ]; then
  cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release >/dev/null
  nice cmake --build "$BUILD" -j2 --target transom
fi
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

echo "FTAR frame size | float32 sum | $(nproc) CPUs | baseline --chunk $BASE | best of $REPEAT interleaved runs"
echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
# interleaved size by size: the load drifts within seconds here
for r in $(seq "$REPEAT"); do
  for n in $RANKS; do
    for size in ${SIZES//,/ }; do
      for c in $BASE $CHUNKS; do
        "$BUILD/transom" ftar-bench --ranks "$n" --sizes "$size" --tcp --chunk "$c" 2>/dev/null | grep '^ftar-bw' | sed "s/^/tcp $c /" >>"$TMP/out" || true
        "$BUILD/transom" ftar-bench --ranks "$n" --sizes "$size" --chunk "$c" 2>/dev/null | grep '^ftar-bw' | sed "s/^/shm $c /" >>"$TMP/out" || true
      done
    done
  done
done
# a run that printed no ftar-bw line (it failed: ftar-bench's stderr is
# dropped to keep the table readable) shows as "no run"
awk -v base="$BASE" -v chunks="$CHUNKS" '
  function field(line, key,   i, a, kv, k) { k = split(line, a, " "); for (i = 1; i <= k; i++) { split(a[i], kv, "="); if (kv[1] == key) return kv[2] } return "" }
  function human(b) { if (b >= 1048576) return (b / 1048576) " MiB"; if (b >= 1024) return (b / 1024) " KiB"; return b " B" }
  { t = $1; c = $2; n = field($0, "ranks"); b = field($0, "bytes"); v = field($0, "busbw") + 0
    if (v > best[t, n, c, b]) best[t, n, c, b] = v
    if (!((n, b) in seen)) { seen[n, b] = 1; order[++no] = n SUBSEP b } }
  END {
    m = split(chunks, cs, " ")
    for (ti = 1; ti <= 2; ti++) {
      t = ti == 1 ? "tcp" : "shm"
      printf "\n%s (busbw GB/s)\n%6s %10s %10s", t, "ranks", "size", "c=" base
      for (j = 1; j <= m; j++) printf " %10s %9s", "c=" cs[j], "ratio"
      printf "\n"
      for (i = 1; i <= no; i++) {
        split(order[i], nb, SUBSEP); n = nb[1]; b = nb[2]; x = best[t, n, base, b]
        printf "%6s %10s %10s", n, human(b), (x > 0 ? sprintf("%.3f", x) : "no run")
        for (j = 1; j <= m; j++) {
          y = best[t, n, cs[j], b]
          printf " %10s %9s", (y > 0 ? sprintf("%.3f", y) : "no run"), (x > 0 && y > 0 ? sprintf("%.2fx", y / x) : "-")
        }
        printf "\n"
      }
    }
  }' "$TMP/out"
echo
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
