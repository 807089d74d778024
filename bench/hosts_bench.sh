#!/usr/bin/env bash
# hosts_bench.sh — what a failure costs across hosts, beside one host: the
# same 2-replica job (each step padded to STEP_MS, a GPU's step time, so the
# test machine's cores are not what is measured) run
#   (1) on one host, fault-free (the useful step time),
#   (2) on one host with a replica killed every K steps (chaos list),
#   (3) on test hosts (spec/hosts/testhosts.sh: the operator on h1, agents on
#       h2, h3 and a spare per kill), fault-free,
#   (4) on test hosts with a whole host (agent and workers) killed every K
#       steps.
# Prints each run's ETTR (useful time / wall), the survivors' stall per
# failure in step times, and the time from a failure (the kill) to its
# replacement being ready. Needs root (network namespaces).
#
#   bench/hosts_bench.sh [CORPUS]
#   env STEPS=400 K=100 STEP_MS=40 TRANSOM=build/transom
set -euo pipefail
cd "$(dirname "$0")/.."
corpus=$(realpath "${1:-../shared/data/tinyshakespeare.txt}")
STEPS=${STEPS:-400}
K=${K:-100}
STEP_MS=${STEP_MS:-40}
BIN=$(realpath "${TRANSOM:-build/transom}")
TH=spec/hosts/testhosts.sh
out=$(realpath -m "${OUT:-bench/out/hosts}")
rm -rf "$out" && mkdir -p "$out"
kills=$(( (STEPS - 1) / K ))
NAME=hb$$
$TH probe >/dev/null || { echo "hosts_bench: cannot make network namespaces here ($($TH probe))"; exit 77; }
trap '$TH down $NAME >/dev/null 2>&1' EXIT

chaos=""
for ((s = K; s < STEPS; s += K)); do chaos+="{ at_step = $s, replica = 1, fault = \"kill\" }, "; done
for name in clean faults; do
  cat > "$out/$name.lua" <<LUA
return {
  data = "$corpus", replicas = 2, max_steps = $STEPS,
  n_layer = 2, n_head = 2, n_embd = 64, block_size = 32, batch_size = 8,
  eval_interval = 0, eval_steps = 5, sample_tokens = 0, log_interval = 100,
  checkpoint = { every_steps = 50 }, deadline = 2, threads = 1,
  chaos = { $([ "$name" = faults ] && echo "$chaos") },
}
LUA
done

stamp() { date +%s.%N; }
local_run() { # name job
  local t0; t0=$(stamp)
  TRANSOM_TEST_STEP_MS=$STEP_MS "$BIN" run "$out/$2.lua" --set run_dir="$out/$1" > "$out/$1.log" 2>&1
  echo "$t0 $(stamp)" > "$out/$1.wall"
}
best_step() { grep -o '^{"step":[0-9]*,"worker"' "$1/metrics.jsonl" 2>/dev/null | grep -o '[0-9]*' | sort -n | tail -1; }
hosts_run() { # name, with kills (1/0)
  local run=$out/$1 n=$((3 + kills)) t0 op
  $TH up $NAME $n > /dev/null
  t0=$(stamp)
  $TH exec $NAME 1 env MASTER_ADDR=10.77.0.1 MASTER_PORT=29500 TRANSOM_TEST_STEP_MS=$STEP_MS \
    "$BIN" run "$out/clean.lua" --set hosts=2 --set run_dir="$run" > "$run.log" 2>&1 &
  op=$!
  while [ ! -e "$run/secret" ]; do sleep 0.05; done
  for k in $(seq 2 $n); do
    ( $TH exec $NAME $k env TRANSOM_TEST_STEP_MS=$STEP_MS "$BIN" agent --operator 10.77.0.1:29500 \
      --secret-file "$run/secret" --name h$k --cores 1 > "$run-agent$k.log" 2>&1 & ) # not our job: no "Killed" notes
    [ $k = 3 ] && sleep 1 # h2, h3 hold the replicas; the rest are spares
  done
  : > "$run.kills"
  if [ "$2" = 1 ]; then
    for ((s = K; s < STEPS; s += K)); do
      while [ "$(best_step "$run" || echo 0)" -lt $s ] && kill -0 $op 2>/dev/null; do sleep 0.02; done
      local h; h=$(grep -o 'replica 1 placed on host h[0-9]*' "$run/events.jsonl" | tail -1 | grep -o '[0-9]*$')
      echo "$(stamp) $s h$h" >> "$run.kills"
      $TH kill $NAME "$h"
    done
  fi
  wait $op || true
  echo "$t0 $(stamp)" > "$run.wall"
  $TH down $NAME
}
echo "2 replicas, $STEPS steps of >= $STEP_MS ms, a failure every $K steps ($kills), one host vs test hosts"
local_run local_clean clean
local_run local_faults faults
hosts_run hosts_clean 0
hosts_run hosts_faults 1

python3 - "$out" "$STEPS" <<'PY'
import json, statistics, sys
out, steps = sys.argv[1], int(sys.argv[2])
def wall(n):
    a, b = map(float, open(f"{out}/{n}.wall").read().split()); return b - a
def rows(n): return [json.loads(l) for l in open(f"{out}/{n}/metrics.jsonl") if '"worker"' in l]
def events(n): return [json.loads(l) for l in open(f"{out}/{n}/events.jsonl")]
useful = steps * statistics.median(r["step_s"] for r in rows("local_clean"))
def stall(n):
    rs = rows(n); med = statistics.median(r["step_s"] for r in rs); out_ = []
    for e in events(n):
        if e["kind"] != "replica_failed": continue
        near = [r["step_s"] for r in rs if r["worker"] != e["worker"] and e["step"] <= r["step"] <= e["step"] + 3]
        if near: out_.append(sum(max(0.0, x - med) for x in near) / med)
    return out_
def ready(n, kills):
    ev = events(n); lat = []
    fails = [e for e in ev if e["kind"] == "replica_failed"]
    for i, f in enumerate(fails):
        t0 = kills[i] if kills and i < len(kills) else f["time"]
        r = [e for e in ev if e["kind"] == "replica_ready" and e["worker"] == f["worker"] and e["time"] > f["time"]]
        if r: lat.append(r[0]["time"] - t0)
    return lat
for n in ("local_clean", "local_faults", "hosts_clean", "hosts_faults"):
    kills = []
    try: kills = [float(l.split()[0]) for l in open(f"{out}/{n}.kills")]
    except OSError: pass
    s, l = stall(n), ready(n, kills)
    fails = sum(1 for e in events(n) if e["kind"] == "replica_failed")
    line = f"{n:13s} wall {wall(n):6.1f} s | ETTR {useful / wall(n):.3f} | failures {fails}"
    if s: line += f" | survivors' stall {statistics.mean(s):.2f} steps/failure (max {max(s):.2f})"
    if l: line += f" | failure -> replacement ready {statistics.mean(l):.2f} s (max {max(l):.2f})"
    print(line)
PY
