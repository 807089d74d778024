#!/usr/bin/env bash
# operator_bench.sh — what failures cost: the same multi-replica job run
#   (1) fault-free, (2) with a replica killed every K steps in transom's mode
#   (only the failed replica is replaced; it catches up from a peer), and
#   (3) the same kills with on_failure = "restart_all" (what torchrun does:
#   stop everything, reload the newest checkpoint),
# in one script. Prints each run's ETTR (useful step time / wall time, the
# useful step time being the fault-free run's median step time), the ratio
# transom / restart_all, and the survivors' stall per failure in step times.
#
#   bench/operator_bench.sh [CORPUS]
#   env STEPS=500 K=50 REPLICAS=2 CKPT=25 TRANSOM=build/transom
#
# REPLICAS defaults to 2 on purpose: each replica runs one thread, and with
# more replicas than cores, losing one speeds the others up (ETTR > 1), which
# says nothing about fault tolerance. CKPT is the checkpoint interval both
# modes use; restart_all loses the steps since the last checkpoint, plus a
# restart (here a process start and an LMDB load: well under a second; on a
# real cluster, rescheduling and communicator set-up take minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
corpus=${1:-../shared/data/tinyshakespeare.txt}
STEPS=${STEPS:-500}
K=${K:-50}
REPLICAS=${REPLICAS:-2}
CKPT=${CKPT:-25}
BIN=${TRANSOM:-build/transom}
out=${OUT:-bench/out/operator}
rm -rf "$out" && mkdir -p "$out"

# the kills: every K steps, rotating over the replicas
chaos=""
for ((s = K, r = 1; s < STEPS; s += K, r = (r + 1) % REPLICAS)); do
  chaos+="{ at_step = $s, replica = $r, fault = \"kill\" }, "
done
for name in clean faults; do
  cat > "$out/$name.lua" <<LUA
return {
  data = "$corpus", replicas = $REPLICAS, max_steps = $STEPS,
  n_layer = 4, n_head = 4, n_embd = 128, block_size = 64, batch_size = 12,
  eval_interval = 0, eval_steps = 5, sample_tokens = 0, log_interval = 100,
  checkpoint = { every_steps = $CKPT }, deadline = 2,
  chaos = { $([ "$name" = faults ] && echo "$chaos") },
}
LUA
done

run() { # name, job, extra args
  local t0 t1
  t0=$(date +%s.%N)
  "$BIN" run "$out/$2.lua" --set run_dir="$out/$1" "${@:3}" > "$out/$1.log" 2>&1
  t1=$(date +%s.%N)
  echo "$t0 $t1" > "$out/$1.wall"
}
echo "$REPLICAS replicas, $STEPS steps, a replica killed every $K steps ($(( (STEPS - 1) / K )) kills), checkpoints every $CKPT"
run clean clean
run transom faults
run restart_all faults --set on_failure=restart_all

python3 - "$out" "$STEPS" <<'PY'
import json, statistics, sys
out, steps = sys.argv[1], int(sys.argv[2])
def wall(name):
    a, b = map(float, open(f"{out}/{name}.wall").read().split())
    return b - a
def metrics(name):
    rows = [json.loads(l) for l in open(f"{out}/{name}/metrics.jsonl") if '"worker"' in l]
    return rows
def events(name):
    return [json.loads(l) for l in open(f"{out}/{name}/events.jsonl")]
clean = metrics("clean")
step_s = statistics.median(r["step_s"] for r in clean)
useful = steps * step_s
ettr = {n: useful / wall(n) for n in ("clean", "transom", "restart_all")}
for n in ("clean", "transom", "restart_all"):
    fails = sum(1 for e in events(n) if e["kind"] == "replica_failed")
    print(f"{n:12s} wall {wall(n):7.1f} s | useful {useful:6.1f} s | ETTR {ettr[n]:.3f} | failures {fails}")
print(f"RATIO ETTR transom/restart_all = {ettr['transom'] / ettr['restart_all']:.2f} (target >= 1.5)")
print(f"ETTR transom with a kill every K steps = {ettr['transom']:.3f} (target >= 0.9)")
# survivors' stall: for each kill, the extra time of the survivors' steps
# right after it, in units of the median step time
rows = metrics("transom")
by = {}
for r in rows:
    by.setdefault(r["worker"], []).append(r)
med = statistics.median(r["step_s"] * 1e3 for r in rows)
stalls = []
for e in events("transom"):
    if e["kind"] != "replica_failed":
        continue
    s, dead = e["step"], e["worker"]
    extra = []
    for w, rs in by.items():
        if w == dead:
            continue
        near = [r["step_s"] * 1e3 for r in rs if s <= r["step"] <= s + 3]
        if near:
            extra.append(sum(max(0.0, m - med) for m in near) / med)
    if extra:
        stalls.append(max(extra))
if stalls:
    print(f"survivors' stall per failure = {statistics.mean(stalls):.2f} steps (mean of {len(stalls)}; max "
          f"{max(stalls):.2f}; target <= 1)")
PY
