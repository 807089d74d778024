#!/usr/bin/env bash
# ftar_frames.sh — one FTAR data-plane knob against a baseline value, in the
# same run: busbw of `transom ftar-bench` with each candidate, 2 and 4
# ranks. Runs are interleaved size by size and the best per size kept (a
# shared machine's load moves every number). Prints busbw per candidate
# and its ratio to the baseline. KNOB picks what varies:
#   chunk       the largest frame (ftar_member_opts.chunk_bytes), TCP (--tcp:
#               a host per rank, so 4 ranks take the grid) and shared memory;
#               default 128 KiB against 256 KiB: smaller frames let each
#               step's next hop start sooner, where 4 ranks share 2 cores
#   shm-ring    the shared-memory ring's size (opts.shm_ring_bytes), shared
#               memory only; default 1 MiB against 4 MiB
#   shm-stores  how the sender stores into its ring (opts.shm_stream):
#               "stream" (non-temporal) and "auto" (the default: the faster
#               of the two, timed as it goes) against "cached" (plain)
#   save-stores how a rank saves the input a collective overwrites (read
#               back only to undo an aborted one; ftar_ring.c): "stream"
#               (non-temporal) and "auto" (the default: non-temporal once
#               the machine's ranks hold more than its last-level cache)
#               against "plain", TCP and shared memory
#               (TRANSOM_FTAR_SAVE_NT=1 / unset / 0)
#   crc-path    the widest CRC32C path the frames' checksums may take
#               (TRANSOM_CRC32C_LEVEL; build/crc_paths prints what each
#               runs at here): 2 (AVX2 + VPCLMULQDQ folding) and 3
#               (AVX-512) against 1 (three crc32q streams), TCP and shared
#               memory; a path the CPU lacks runs the next one down
# Shared-memory figures depend on whether the two ranks' cores share a
# cache; on this project's 2-vCPU VMs that flips from minute to minute (the
# hypervisor moves the vCPUs). Each run is tagged with the cache-line round
# trip between CPUs 0 and 1 (bench/core_rtt.c) taken just before it and
# again after (a run during which the kind changed is left out), and the
# tables are kept apart: "near" below 150 ns (a shared cache), "far" above.
#
#   bench/ftar_frames.sh
#   BASE=262144 CHUNKS="131072 65536" RANKS="4" SIZES=4M,16M REPEAT=5 bench/ftar_frames.sh
#   KNOB=shm-stores RANKS=2 bench/ftar_frames.sh
#   KNOB=shm-ring BASE=4194304 CHUNKS="1048576 2097152" bench/ftar_frames.sh
#   KNOB=save-stores RANKS=2 SIZES=1M,4M,16M,64M bench/ftar_frames.sh
#   KNOB=crc-path CHUNKS=2 RANKS=2 SIZES=1M,2M,4M bench/ftar_frames.sh
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD=${BUILD:-build}
SIZES=${SIZES:-64K,256K,1M,4M,16M,64M}
RANKS=${RANKS:-"2 4"}
REPEAT=${REPEAT:-3}
KNOB=${KNOB:-chunk}
case "$KNOB" in
  chunk) BASE=${BASE:-262144} CHUNKS=${CHUNKS:-131072} PLANES="tcp shm" ;;
  shm-ring) BASE=${BASE:-4194304} CHUNKS=${CHUNKS:-1048576} PLANES="shm" ;;
  shm-stores) BASE=${BASE:-cached} CHUNKS=${CHUNKS:-"stream auto"} PLANES="shm" ;;
  save-stores) BASE=${BASE:-plain} CHUNKS=${CHUNKS:-"stream auto"} PLANES="tcp shm" ;;
  crc-path) BASE=${BASE:-1} CHUNKS=${CHUNKS:-"2 3"} PLANES="tcp shm" ;;
  *) echo "ftar_frames.sh: KNOB must be chunk, shm-ring, shm-stores, save-stores or crc-path, not '$KNOB'" >&2; exit 2 ;;
esac
if [ ! -x "$BUILD/transom" ]; then
  cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release >/dev/null
  nice cmake --build "$BUILD" -j2 --target transom
fi
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
cc -O2 -pthread -o "$TMP/core_rtt" bench/core_rtt.c
rtt() { "$TMP/core_rtt" 2>/dev/null | sed -n 's/.*ns=//p' || true; }

# the ftar-bench arguments that set the knob to $1
knob_args() {
  case "$KNOB" in
    chunk) echo "--chunk $1" ;;
    shm-ring) echo "--shm-ring $1" ;;
    shm-stores) echo "--shm-stores $1" ;;
  esac
}
# ... and the environment (save-stores: ftar_ring.c reads it; crc-path:
# crc32c.c)
knob_env() {
  case "$KNOB:$1" in
    crc-path:*) echo "TRANSOM_CRC32C_LEVEL=$1" ;;
    save-stores:plain) echo "TRANSOM_FTAR_SAVE_NT=0" ;;
    save-stores:stream) echo "TRANSOM_FTAR_SAVE_NT=1" ;;
    *) echo "TRANSOM_FTAR_SAVE_NT=" ;;
  esac
}

echo "FTAR $KNOB | float32 sum | $(nproc) CPUs | baseline $BASE | best of $REPEAT interleaved runs"
echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
# interleaved size by size: the load drifts within seconds here
for r in $(seq "$REPEAT"); do
  for n in $RANKS; do
    for size in ${SIZES//,/ }; do
      for c in $BASE $CHUNKS; do
        args=$(knob_args "$c")
        kenv=$(knob_env "$c")
        for t in $PLANES; do
          plane=""
          [ "$t" = tcp ] && plane=--tcp
          ns=$(rtt)
          # shellcheck disable=SC2086 # args is a list of words
          out=$(env "$kenv" "$BUILD/transom" ftar-bench --ranks "$n" --sizes "$size" $plane $args 2>/dev/null | grep '^ftar-bw' || true)
          # -1: the cores changed kind during the run (not counted)
          ns=$(echo "${ns:-0} $(rtt)" | awk '{ print ($1 > 0 && $2 > 0 && ($1 < 150) != ($2 < 150)) ? -1 : $1 + 0 }')
          [ -n "$out" ] && echo "$out" | sed "s/^/$t $c $ns /" >>"$TMP/out"
        done
      done
    done
  done
done
# a run that printed no ftar-bw line (it failed: ftar-bench's stderr is
# dropped to keep the table readable) shows as "no run"
awk -v base="$BASE" -v chunks="$CHUNKS" -v planes="$PLANES" -v knob="$KNOB" '
  function field(line, key,   i, a, kv, k) { k = split(line, a, " "); for (i = 1; i <= k; i++) { split(a[i], kv, "="); if (kv[1] == key) return kv[2] } return "" }
  function human(b) { if (b >= 1048576) return (b / 1048576) " MiB"; if (b >= 1024) return (b / 1024) " KiB"; return b " B" }
  $3 < 0 { mixed++; next }
  { t = $1; c = $2; near = $3 == 0 ? "any" : $3 < 150 ? "near" : "far"; n = field($0, "ranks"); b = field($0, "bytes"); v = field($0, "busbw") + 0
    if (t == "tcp" && knob != "save-stores") near = "any"
    k = t SUBSEP near; runs[k]++; rtt[k] += $3
    if (v > best[k, n, c, b]) best[k, n, c, b] = v
    if (!((n, b) in seen)) { seen[n, b] = 1; order[++no] = n SUBSEP b } }
  END {
    if (mixed) printf "\n(not counted: %d runs during which the cores changed kind)\n", mixed
    m = split(chunks, cs, " ")
    np = split(planes, ps, " ")
    for (pi = 1; pi <= np; pi++) for (gi = 1; gi <= 3; gi++) {
      t = ps[pi]; g = gi == 1 ? "any" : gi == 2 ? "near" : "far"; k = t SUBSEP g
      if (!(k in runs)) continue
      if (g == "any") printf "\n%s (busbw GB/s)\n", t
      else printf "\n%s, cores %s (busbw GB/s; %d runs, mean cache-line round trip %.0f ns)\n", t, g == "near" ? "sharing a cache" : "sharing no cache", runs[k], rtt[k] / runs[k]
      printf "%6s %10s %10s", "ranks", "size", base
      for (j = 1; j <= m; j++) printf " %10s %9s", cs[j], "ratio"
      printf "\n"
      for (i = 1; i <= no; i++) {
        split(order[i], nb, SUBSEP); n = nb[1]; b = nb[2]; x = best[k, n, base, b]
        printf "%6s %10s %10s", n, human(b), (x > 0 ? sprintf("%.3f", x) : "no run")
        for (j = 1; j <= m; j++) {
          y = best[k, n, cs[j], b]
          printf " %10s %9s", (y > 0 ? sprintf("%.3f", y) : "no run"), (x > 0 && y > 0 ? sprintf("%.2fx", y / x) : "-")
        }
        printf "\n"
      }
    }
  }' "$TMP/out"
echo
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
