#!/usr/bin/env bash
# ftar_hier_bench.sh — FTAR across test hosts against OpenMPI's MPI_Allreduce
# across the same hosts (issue 13, item 3).
#
# The test bed: H test hosts (network namespaces NAME-h1..hH on one bridge,
# spec/hosts/testhosts.sh; host k is $NET.k), each link optionally limited
# with tc tbf to RATE both ways, RANKS_PER_HOST ranks on every host, host-
# major (ranks 0..R-1 on h1, R..2R-1 on h2, ...). Three implementations run
# on the same hosts, interleaved, REPEAT times, and the best run per size is
# kept (the neighbours' load moves every number; interleaving exposes all
# three to the same conditions):
#   FTAR-flat  `transom ftar-bench rank` in each namespace, a coordinator in
#              h1; today's flat ring (shared memory between same-host
#              neighbours, TCP across hosts). `--flat` when the build has it.
#   FTAR-hier  the hierarchical plane (shared memory inside a host, a ring of
#              host leaders across hosts, broadcast back), when the build's
#              `ftar-bench rank` takes --flat (hier is then its default across
#              hosts); else "hierarchical: not available in this build". With
#              RANKS_PER_HOST=1 and an even number >= 4 of hosts this column is
#              the grid (pairs x columns, FTAR's default there): "FTAR-grid".
#   OpenMPI    bench/mpi_allreduce.c under mpirun run in h1, ranks launched
#              into the other namespaces by an rsh agent the bench writes
#              (ip netns exec NS + a UTS namespace with the host's own
#              hostname, which Open MPI needs: its shared-memory segment
#              and session names contain the hostname, so namespaces that all
#              say "vm" collide: "unlink(2) /dev/shm/vader_segment.vm..."),
#              pml ob1, btl tcp,self + vader (sm on Open MPI 5): shared
#              memory inside a host as FTAR, TCP only on the test subnet.
# busbw = algbw * 2(n-1)/n (nccl-tests' convention), float32 sum, in place,
# the slowest rank's time, iterations as `ftar-bench` chooses (--iters auto).
# Ratios are between runs of this script, never against a number from
# elsewhere. Neither side pins ranks (each host would pin its ranks to the
# same cores of this one machine), and with more ranks than CPUs in all (the
# hosts share this machine's cores) Open MPI gets mpi_yield_when_idle=1 (what
# mpirun sets itself when it sees the oversubscription; across "hosts" it
# cannot: without it, busy-polling ranks took 12-27 ms per 64 KiB). Then, optionally, the recovery time after kill -9 of the last rank
# on h2 in the middle of a 16 MiB all-reduce (flat, and hier when there).
# Needs root (namespaces). Usage:
#
#   bench/ftar_hier_bench.sh                          H = 2 and 3, 2 ranks/host, 1gbit
#   HOSTS="2" RANKS_PER_HOST=2 SIZES=64K,1M REPEAT=1 RATE=none bench/ftar_hier_bench.sh
#   env: HOSTS ("2 3") RANKS_PER_HOST (2) SIZES (64K,1M,16M,64M) REPEAT (2)
#        RATE (1gbit; 'none': no tbf) NET (10.83.0) RECOVERY (1; 0: skip)
#        BUILD (build) RUN_TIMEOUT (600 s per run) DEADLINE (3 s, coordinator)
#
# Installs openmpi-bin and libopenmpi-dev (Debian) if mpirun/mpicc are
# missing; builds transom in $BUILD if needed. Exit 0 with the table; 1 with
# a message naming the step that failed; 77 if namespaces cannot be made.
set -euo pipefail
cd "$(dirname "$0")/.."
PATH=/usr/sbin:/sbin:$PATH

HOSTS=${HOSTS:-"2 3"}
RPH=${RANKS_PER_HOST:-2}
SIZES=${SIZES:-64K,1M,16M,64M}
REPEAT=${REPEAT:-2}
RATE=${RATE:-1gbit}
NET=${NET:-10.83.0}
RECOVERY=${RECOVERY:-1}
BUILD=${BUILD:-build}
RUN_TIMEOUT=${RUN_TIMEOUT:-600}
DEADLINE=${DEADLINE:-3}
TH=spec/hosts/testhosts.sh
NAME=fhb$(($$ % 1000000)) # <= 9 characters: interface names are short

die() { echo "ftar_hier_bench: $*" >&2; exit 1; }
note() { echo "ftar_hier_bench: $*" >&2; }

[[ $RPH =~ ^[1-9][0-9]?$ ]] || die "RANKS_PER_HOST must be 1..99: $RPH"
[[ $REPEAT =~ ^[1-9][0-9]*$ ]] || die "REPEAT must be >= 1: $REPEAT"
for h in $HOSTS; do [[ $h =~ ^[0-9]+$ ]] && [ "$h" -ge 2 ] && [ "$h" -le 32 ] || die "HOSTS entries must be 2..32: $h"; done
[[ $SIZES =~ ^[0-9]+[KMG]?(,[0-9]+[KMG]?)*$ ]] || die "SIZES must be a list like 64K,1M,16M: $SIZES"
[[ $NET =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "NET must be three octets like 10.83.0: $NET"

# --- cleanup: what this script started, then its namespaces ---
TMP=$(mktemp -d /tmp/ftar_hier_bench.XXXXXX)
cleanup() { # every process started here runs in this script's namespaces, or is a job of it
  local rc=$? p
  trap - EXIT INT TERM
  for p in $(jobs -pr); do kill -9 "$p" 2>/dev/null || true; done
  $TH down "$NAME" >/dev/null 2>&1 || note "could not delete every namespace of $NAME: ip netns list | grep $NAME"
  rm -rf "$TMP"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# --- prerequisites ---
$TH probe >/dev/null || { echo "ftar_hier_bench: cannot make network namespaces here ($($TH probe))"; exit 77; }
spec/apt_need.sh ftar_hier_bench mpirun:openmpi-bin mpicc:libopenmpi-dev || die "installing openmpi-bin libopenmpi-dev failed"
if [ ! -x "$BUILD/transom" ]; then
  cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release >/dev/null || die "cmake configure failed"
  nice cmake --build "$BUILD" -j2 --target transom >/dev/null || die "building transom failed"
fi
BIN=$(realpath "$BUILD/transom")
MPIBIN=$TMP/mpi_allreduce
mpicc -O3 -o "$MPIBIN" bench/mpi_allreduce.c || die "mpicc bench/mpi_allreduce.c failed"
"$BIN" ftar-bench rank --help | grep -q -- '--host' ||
  die "$BIN: ftar-bench rank has no --host (the address a rank listens on); rebuild transom"

OMPI_VERSION=$(mpirun --version 2>/dev/null | head -1 | awk '{print $NF}')
[ -n "$OMPI_VERSION" ] || die "mpirun --version printed nothing"
SHM_BTL=vader
[ "${OMPI_VERSION%%.*}" -ge 5 ] && SHM_BTL=sm # renamed in Open MPI 5

# The hierarchical plane: its build takes --flat (force the flat ring); this
# one refuses unknown options with status 2 before it reads --help.
HIER=0
if "$BIN" ftar-bench rank --flat --help >/dev/null 2>&1 || "$BIN" ftar-bench --help 2>/dev/null | grep -q -- '--flat'; then
  HIER=1
fi
FLAT_FLAGS=()
[ "$HIER" = 1 ] && FLAT_FLAGS=(--flat)

# sizes in bytes, in order
SIZE_BYTES=$(echo "$SIZES" | tr ',' '\n' | awk '{ x = $1; m = 1; if (x ~ /K$/) m = 1024; else if (x ~ /M$/) m = 1048576; else if (x ~ /G$/) m = 1073741824; sub(/[KMG]$/, "", x); print x * m }')
NSIZES=$(echo "$SIZE_BYTES" | wc -l)

# --- FTAR: a coordinator in h1, RPH ranks per host ---

# Starts the coordinator in h1 with DEADLINE; sets COORD_PID and COORD_PORT.
coord_start() { # deadline
  local out=$TMP/coord.out fifo=$TMP/coord.in
  : >"$out"
  # stdin: a fifo it holds open itself (read-write): no EOF, it runs until SIGTERM
  [ -p "$fifo" ] || mkfifo "$fifo" || die "mkfifo $fifo failed"
  ip netns exec "$NAME-h1" "$BIN" ftar-bench coord --host "$NET.1" --port 0 --deadline "$1" <>"$fifo" >"$out" 2>&1 &
  COORD_PID=$!
  COORD_PORT=""
  for _ in $(seq 1 100); do
    COORD_PORT=$(sed -n 's/^ftar-coord port=\([0-9]*\).*/\1/p' "$out")
    [ -n "$COORD_PORT" ] && return 0
    kill -0 "$COORD_PID" 2>/dev/null || break
    sleep 0.1
  done
  die "the FTAR coordinator in $NAME-h1 did not start within 10 s: $(tail -3 "$out")"
}
coord_stop() {
  kill -TERM "$COORD_PID" 2>/dev/null || true
  for _ in $(seq 1 50); do kill -0 "$COORD_PID" 2>/dev/null || break; sleep 0.1; done
  kill -9 "$COORD_PID" 2>/dev/null || true
  wait "$COORD_PID" 2>/dev/null || true
}

# Rank s of an H-host run: its host number.
host_of() { echo $(($1 / RPH + 1)); }

# Starts every rank of an H-host run (extra rank options after the label);
# their outputs in $TMP/rank.S, the PIDs of their subshells in RANK_PIDS (a
# subshell that exits with timeout's status, its stderr (bash's "Killed"
# notice when recovery kills a rank) dropped; a rank's PID is in its ftar-ready line).
ranks_start() { # H label opts...
  local h=$1 label=$2 n=$(($1 * RPH)) s k
  shift 2
  RANK_PIDS=()
  for ((s = 0; s < n; s++)); do
    k=$(host_of $s)
    (timeout -k 5 "$RUN_TIMEOUT" ip netns exec "$NAME-h$k" "$BIN" ftar-bench rank --coord "$NET.1:$COORD_PORT" \
      --host "$NET.$k" --slot $s --wait $n "$@" >"$TMP/rank.$s" 2>&1 || exit $?) 2>/dev/null &
    RANK_PIDS+=($!)
  done
}

# One FTAR sweep over SIZES; appends "bw impl=LABEL ..." lines to $TMP/bw.H.
ftar_run() { # H label opts...
  local h=$1 label=$2 n=$(($1 * RPH)) s rc fail=""
  shift 2
  coord_start "$DEADLINE"
  ranks_start "$h" "$label" --sizes "$SIZES" --iters auto --warmup 2 --quiet --no-bind "$@"
  for ((s = 0; s < n; s++)); do
    rc=0
    wait "${RANK_PIDS[$s]}" || rc=$?
    if [ $rc != 0 ]; then
      fail+=$(printf '\n  rank %d (host %d): exit %d%s\n%s' $s "$(host_of $s)" $rc \
        "$( ( [ $rc = 124 ] || [ $rc = 137 ] ) && echo ", timed out after $RUN_TIMEOUT s")" "$(tail -3 "$TMP/rank.$s" | sed 's/^/    /')")
    fi
  done
  coord_stop
  [ -z "$fail" ] || die "FTAR $label across $h hosts failed:$fail"
  cat "$TMP"/rank.* >"$TMP/ftar.$label.$h.last"
  awk -v impl="$label" -v n="$n" -v want="$NSIZES" -v rph="$RPH" '
    /^ftar-time/ {
      for (i = 2; i <= NF; i++) { split($i, kv, "="); f[kv[1]] = kv[2] }
      c = f["count"]; got[c]++; it[c] = f["iters"]; if (f["sec"] > worst[c]) worst[c] = f["sec"]
    }
    END {
      m = 0
      for (c in got) {
        if (got[c] != n) { printf "count %s: %d of %d ranks reported a time\n", c, got[c], n > "/dev/stderr"; exit 1 }
        m++; b = c * 4; t = worst[c] / it[c]; alg = b / t / 1e9
        printf "bw impl=%s ranks=%d bytes=%d iters=%d us=%.3f algbw=%.4f busbw=%.4f\n", impl, n, b, it[c], t * 1e6, alg, alg * 2 * (n - 1) / n
      }
      if (m != want) { printf "%d of %d sizes have times\n", m, want > "/dev/stderr"; exit 1 }
    }' "$TMP"/rank.* >>"$TMP/bw.$h" || die "FTAR $label across $h hosts: missing ftar-time lines (outputs: $TMP/rank.*)"
  rm -f "$TMP"/rank.*
}

# --- OpenMPI: mpirun in h1, an rsh agent into the other namespaces ---

# The agent mpirun calls as `AGENT [options] HOST orted ...` (the command as
# words a remote shell would join and run): HOST (address or hostname) ->
# its namespace, run there with the namespace's name as hostname.
write_agent() { # H
  local h=$1 k
  {
    echo '#!/bin/sh'
    echo '# written by bench/ftar_hier_bench.sh: mpirun rsh agent into test-host namespaces'
    echo 'while [ $# -gt 0 ]; do case $1 in -*) shift ;; *) break ;; esac; done'
    echo 'host=$1; shift'
    echo 'case $host in'
    for ((k = 1; k <= h; k++)); do echo "  $NET.$k|$NAME-h$k) ns=$NAME-h$k ;;"; done
    echo '  *) echo "mpi agent: unknown host $host" >&2; exit 255 ;;'
    echo 'esac'
    echo "exec ip netns exec \"\$ns\" unshare --uts /bin/sh -c 'hostname \"\$0\" && exec /bin/sh -c \"\$1\"' \"\$ns\" \"\$*\""
  } >"$TMP/agent"
  chmod +x "$TMP/agent"
  for ((k = 1; k <= h; k++)); do echo "$NET.$k slots=$RPH"; done >"$TMP/hostfile"
}

mpi_args() { # H: sets MPI_ARGS
  local n=$(($1 * RPH))
  MPI_ARGS=(--allow-run-as-root -np "$n" --hostfile "$TMP/hostfile" --map-by slot --bind-to none
    --mca plm_rsh_agent "$TMP/agent" --mca plm_rsh_no_tree_spawn 1
    --mca pml ob1 --mca btl "tcp,self,$SHM_BTL"
    --mca btl_tcp_if_include "$NET.0/24" --mca oob_tcp_if_include "$NET.0/24")
  [ "$n" -gt "$(nproc)" ] && MPI_ARGS+=(--mca mpi_yield_when_idle 1)
  return 0
}

mpi_run() { # H
  local h=$1 rc=0
  mpi_args "$h"
  timeout -k 5 "$RUN_TIMEOUT" ip netns exec "$NAME-h1" unshare --uts /bin/sh -c 'hostname "$0" && exec "$@"' \
    "$NAME-h1" mpirun "${MPI_ARGS[@]}" "$MPIBIN" ${SIZES//,/ } >"$TMP/mpi.out" 2>"$TMP/mpi.err" &
  wait $! || rc=$?
  [ $rc = 0 ] || die "OpenMPI across $h hosts failed (exit $rc$( ( [ $rc = 124 ] || [ $rc = 137 ] ) && echo ", timed out after $RUN_TIMEOUT s")):"$'\n'"$(tail -15 "$TMP/mpi.err")"
  [ "$(grep -c '^mpi-bw' "$TMP/mpi.out")" = "$NSIZES" ] ||
    die "OpenMPI across $h hosts printed $(grep -c '^mpi-bw' "$TMP/mpi.out") of $NSIZES mpi-bw lines:"$'\n'"$(tail -15 "$TMP/mpi.err")"
  # setpgid's EACCES: the child had exec'd already and set its group itself (a benign race of plm rsh)
  grep -v 'plm:rsh: Warning: setpgid(.*) failed in parent with errno=Permission denied' "$TMP/mpi.err" >"$TMP/mpi.err2" || true
  if grep -qi 'error\|failed' "$TMP/mpi.err2"; then
    die "OpenMPI across $h hosts reported an error (its numbers are not trusted):"$'\n'"$(grep -i -m5 -B2 -A4 'error\|failed' "$TMP/mpi.err2")"
  fi
  sed 's/^mpi-bw /bw impl=mpi /' "$TMP/mpi.out" | grep '^bw ' >>"$TMP/bw.$h"
}

# --- recovery: kill -9 of the last rank on h2 mid all-reduce ---

mono() { python3 -c 'import time; print("%.6f" % time.clock_gettime(time.CLOCK_MONOTONIC))'; }
nresults() { grep -c '^ftar-result' "$1" 2>/dev/null || true; }

recovery_run() { # H label opts...
  local h=$1 label=$2 n=$(($1 * RPH)) victim=$((2 * RPH - 1)) s vpid t_sig ready
  shift 2
  coord_start 1
  ranks_start "$h" "$label" --counts 4M --iters 1000000 --max-sec 60 --verify --no-bind "$@"
  for _ in $(seq 1 300); do # every rank done with 2 collectives (30 s at most)
    ready=1
    for ((s = 0; s < n; s++)); do [ "$(nresults "$TMP/rank.$s")" -ge 2 ] || ready=0; done
    [ $ready = 1 ] && break
    sleep 0.1
  done
  [ $ready = 1 ] || die "recovery ($label, $h hosts): the ranks did not start within 30 s: $(tail -2 "$TMP/rank.0")"
  vpid=$(sed -n 's/^ftar-ready .*pid=\([0-9]*\).*/\1/p' "$TMP/rank.$victim")
  [ -n "$vpid" ] || die "recovery: rank $victim printed no pid"
  # a random point of a collective: after the victim's latest result, 20-80% of a collective's time
  sleep "$(awk -v r=$RANDOM '/^ftar-result/ { for (i = 2; i <= NF; i++) { split($i, kv, "="); f[kv[1]] = kv[2] } d += f["t1"] - f["t0"]; k++ }
    END { printf "%.4f", (k ? d / k : 0.05) * (0.2 + 0.6 * r / 32767) }' "$TMP/rank.0")"
  t_sig=$(python3 -c 'import os, time; t = time.clock_gettime(time.CLOCK_MONOTONIC); os.kill('"$vpid"', 9); print("%.6f" % t)') ||
    die "recovery: could not kill rank $victim (pid $vpid)"
  for _ in $(seq 1 200); do # every survivor finished a collective after the kill (20 s at most)
    ready=1
    for ((s = 0; s < n; s++)); do
      [ $s = $victim ] && continue
      awk -v t="$t_sig" '/^ftar-result/ { for (i = 2; i <= NF; i++) { split($i, kv, "="); f[kv[1]] = kv[2] } if (f["t1"] > t) x = 1 } END { exit !x }' "$TMP/rank.$s" || ready=0
    done
    [ $ready = 1 ] && break
    sleep 0.1
  done
  for ((s = 0; s < n; s++)); do # the survivors stop before their next collective
    [ $s = $victim ] || kill -TERM "$(sed -n 's/^ftar-ready .*pid=\([0-9]*\).*/\1/p' "$TMP/rank.$s")" 2>/dev/null || true
  done
  for ((s = 0; s < n; s++)); do wait "${RANK_PIDS[$s]}" 2>/dev/null || true; done
  coord_stop
  [ $ready = 1 ] || die "recovery ($label, $h hosts): survivors did not finish a collective within 20 s of the kill"
  cat "$TMP"/rank.* | awk -v t="$t_sig" -v v="$victim" -v n="$n" -v label="$label" -v h="$h" '
    /^ftar-error/ && $2 != "slot=" v { err = err "\n  " $0 }
    /^ftar-result/ {
      for (i = 2; i <= NF; i++) { split($i, kv, "="); f[kv[1]] = kv[2] }
      s = f["slot"]; if (s == v || f["t1"] <= t || done[s]) next
      done[s] = 1; if (f["t1"] - t > worst) worst = f["t1"] - t
      if (!f["ok"]) bad++; contrib = f["contrib"]; redos = f["redos"]
    }
    END {
      if (bad || err != "") { printf "recovery %s, %d hosts: wrong results (%d) or errors:%s\n", label, h, bad, err > "/dev/stderr"; exit 1 }
      printf "recovery %-9s %d hosts x %d ranks, kill -9 of rank %d (host 2) in a 16 MiB all-reduce, coordinator deadline 1 s: survivors completed the redo %.1f ms after the kill (contrib %d, redos %d, verified)\n", label, h, n / h, v, worst * 1e3, contrib, redos
    }' || die "recovery ($label, $h hosts) failed"
  rm -f "$TMP"/rank.*
}

# --- the table ---

table() { # H
  local h=$1 n=$(($1 * RPH))
  echo
  echo "$h hosts x $RPH ranks = $n ranks (busbw GB/s, best of $REPEAT)"
  local label=hier
  [ "$RPH" = 1 ] && [ "$n" -ge 4 ] && [ $((n % 2)) = 0 ] && label=grid
  awk -v sizes="$(echo $SIZE_BYTES)" -v hier="$HIER" -v label="$label" '
    function human(b) { if (b >= 1048576) return (b / 1048576) " MiB"; if (b >= 1024) return (b / 1024) " KiB"; return b " B" }
    function ratio(a, b) { return (a > 0 && b > 0) ? sprintf("%.2fx", a / b) : "-" }
    function num(v) { return v > 0 ? sprintf("%.3f", v) : "-" }
    /^bw / {
      for (i = 2; i <= NF; i++) { split($i, kv, "="); f[kv[1]] = kv[2] }
      if (f["busbw"] + 0 > best[f["impl"], f["bytes"]]) best[f["impl"], f["bytes"]] = f["busbw"] + 0
    }
    END {
      printf "%9s %10s %10s %9s %15s %15s %10s\n", "size", "FTAR-" label, "FTAR-flat", "OpenMPI", label "/OpenMPI", "flat/OpenMPI", label "/flat"
      m = split(sizes, s, " ")
      for (i = 1; i <= m; i++) {
        b = s[i]; hb = best["hier", b]; fb = best["flat", b]; mb = best["mpi", b]
        printf "%9s %10s %10s %9s %15s %15s %10s\n", human(b), num(hb), num(fb), num(mb), ratio(hb, mb), ratio(fb, mb), ratio(hb, fb)
      }
    }' "$TMP/bw.$h"
}

links_line() { # H label: slot 0's ftar-done of the last run
  local f=$TMP/ftar.$2.$1.last
  [ -e "$f" ] && echo "  FTAR-$2 links of rank 0: $(grep '^ftar-done slot=0 ' "$f" | grep -o 'shm_links=.*')"
  return 0
}

# --- main ---
echo "FTAR vs OpenMPI $OMPI_VERSION MPI_Allreduce across test hosts | float32 sum | $RPH ranks per host | links $([ "$RATE" = none ] && echo unlimited || echo "at $RATE (tc tbf both ways)") | $(nproc) CPUs shared by every host | best of $REPEAT interleaved runs"
if [ "$HIER" = 1 ]; then echo "hierarchical: available (FTAR-flat runs with --flat)"; else echo "hierarchical: not available in this build"; fi
echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
for h in $HOSTS; do
  $TH up "$NAME" "$h" "$NET" >/dev/null || die "testhosts.sh up $NAME $h $NET failed"
  for ((k = 1; k <= h; k++)); do
    $TH reach "$NAME" 1 "$NET.$k" || die "host 1 does not reach $NET.$k"
    if [ "$RATE" != none ]; then $TH slow "$NAME" "$k" "$RATE" >/dev/null || die "tc tbf $RATE on host $k failed"; fi
  done
  write_agent "$h"
  mpi_args "$h"
  if [ "$h" = "${HOSTS%% *}" ]; then
    echo "OpenMPI: mpirun ${MPI_ARGS[*]} (agent: ip netns exec NS unshare --uts, hostname NS)" | sed "s|$TMP|\$TMP|g"
  fi
  : >"$TMP/bw.$h"
  for ((r = 1; r <= REPEAT; r++)); do
    ftar_run "$h" flat "${FLAT_FLAGS[@]}"
    if [ "$HIER" = 1 ]; then ftar_run "$h" hier; fi
    mpi_run "$h"
  done
  table "$h"
  links_line "$h" flat
  links_line "$h" hier
  if [ "$RECOVERY" = 1 ]; then
    recovery_run "$h" flat "${FLAT_FLAGS[@]}"
    if [ "$HIER" = 1 ]; then recovery_run "$h" hier; fi
  fi
  $TH down "$NAME" >/dev/null || die "testhosts.sh down $NAME failed"
done
echo
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
