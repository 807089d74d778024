#!/usr/bin/env bash
# hosts_overlap_bench.sh — what the all-reduce of a training step exposes
# when replicas span hosts: 4 replicas on 2 test hosts (2 each: FTAR's
# hierarchy, shared memory inside a host, TCP across; links limited with
# tc tbf to RATE), the same job three ways, interleaved ROUNDS times:
#   after     bucket_mb = 0: one all-reduce after backward
#   one-wave  bucket_mb = 1, TRANSOM_FTAR_WAVE_MIN=0: buckets, but the
#             cross-host part waits for the last one (before waves)
#   waves     bucket_mb = 1: the cross-host part in waves of >= 1 MiB while
#             backward writes the next (core/ftar/ftar_hier.c)
# Per run, medians over every replica's steps after the first 10: the step,
# the exposed all-reduce (`allreduce_s`: what the step waited for after
# backward), its share of the step, and the all-reduce's own time
# (`comm_s`); the best round per variant counts. Then the ratios of exposed
# time: after / waves and one-wave / waves. The model is sized so its
# gradients (about 3.3 MB) make 4 waves. Needs root (network namespaces).
#
#   bench/hosts_overlap_bench.sh [CORPUS]
#   env STEPS=60 ROUNDS=2 RATE=1gbit TRANSOM=build/transom
set -euo pipefail
cd "$(dirname "$0")/.."
PATH=/usr/sbin:/sbin:$PATH
corpus=$(realpath "${1:-../shared/data/tinyshakespeare.txt}")
STEPS=${STEPS:-60}
ROUNDS=${ROUNDS:-2}
RATE=${RATE:-1gbit}
BIN=$(realpath "${TRANSOM:-build/transom}")
TH=spec/hosts/testhosts.sh
out=$(realpath -m "${OUT:-bench/out/hosts_overlap}")
NAME=hob$(($$ % 100000))
[[ $STEPS =~ ^[0-9]+$ ]] && [ "$STEPS" -ge 20 ] || { echo "hosts_overlap_bench: STEPS must be >= 20: $STEPS" >&2; exit 1; }
[[ $ROUNDS =~ ^[1-9][0-9]*$ ]] || { echo "hosts_overlap_bench: ROUNDS must be >= 1: $ROUNDS" >&2; exit 1; }
[ -f "$corpus" ] || { echo "hosts_overlap_bench: no corpus at $corpus" >&2; exit 1; }
$TH probe >/dev/null || { echo "hosts_overlap_bench: cannot make network namespaces here ($($TH probe))"; exit 77; }
rm -rf "$out" && mkdir -p "$out"
trap '$TH down $NAME >/dev/null 2>&1' EXIT

cat > "$out/job.lua" <<LUA
return {
  data = "$corpus", replicas = 4, hosts = 2, max_steps = $STEPS,
  n_layer = 4, n_head = 4, n_embd = 128, block_size = 64, batch_size = 8,
  eval_interval = 0, eval_steps = 5, sample_tokens = 0, log_interval = 1000,
  warmup_steps = 5, deadline = 5, threads = 1, detector = false,
}
LUA

run() { # name bucket_mb wave_min
  local run=$out/$1 op k
  $TH up $NAME 3 >/dev/null
  for k in 2 3; do $TH slow $NAME $k "$RATE" >/dev/null; done
  $TH exec $NAME 1 env MASTER_ADDR=10.77.0.1 MASTER_PORT=29500 \
    "$BIN" run "$out/job.lua" --set bucket_mb="$2" --set run_dir="$run" >"$run.log" 2>&1 &
  op=$!
  for _ in $(seq 1 600); do [ -e "$run/secret" ] || ! kill -0 $op 2>/dev/null && break; sleep 0.05; done
  [ -e "$run/secret" ] || { echo "hosts_overlap_bench: the operator did not start: $(tail -3 "$run.log")" >&2; exit 1; }
  for k in 2 3; do # the workers inherit the agents' environment
    ( $TH exec $NAME $k env TRANSOM_FTAR_WAVE_MIN="$3" "$BIN" agent --operator 10.77.0.1:29500 \
      --secret-file "$run/secret" --name h$k --cores 1 --slots 2 >"$run-agent$k.log" 2>&1 & )
  done
  wait $op || { echo "hosts_overlap_bench: run $1 failed: $(tail -3 "$run.log")" >&2; exit 1; }
  $TH down $NAME >/dev/null
}

echo "4 replicas on 2 test hosts (tbf $RATE), $STEPS steps, best of $ROUNDS interleaved rounds, $(nproc) CPUs"
echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
for ((i = 0; i < ROUNDS; i++)); do
  run "after.$i" 0 ""
  run "onewave.$i" 1 0
  run "waves.$i" 1 ""
done

python3 - "$out" "$ROUNDS" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def stats(name):
    rows = [json.loads(l) for l in open(f"{out}/{name}/metrics.jsonl") if '"worker"' in l]
    rows = [r for r in rows if r["step"] > 10]
    med = lambda k: statistics.median(r[k] for r in rows)
    return {"step": med("step_s"), "exposed": med("allreduce_s"), "comm": med("comm_s"),
            "share": statistics.median(r["allreduce_s"] / r["step_s"] for r in rows),
            "hier": "hierarchical" in "".join(open(f"{out}/{name}/worker-{w}.log").read() for w in range(4))}
best = {}
for v in ("after", "onewave", "waves"):
    runs = [stats(f"{v}.{i}") for i in range(rounds)]
    best[v] = min(runs, key=lambda s: s["exposed"])
    b = best[v]
    print(f"{v:8s} step {b['step'] * 1e3:7.1f} ms | exposed all-reduce {b['exposed'] * 1e3:6.1f} ms "
          f"(share {b['share']:.3f}) | all-reduce {b['comm'] * 1e3:6.1f} ms | hierarchical {'yes' if b['hier'] else 'NO'}")
w = best["waves"]["exposed"]
if w > 0:
    print(f"exposed all-reduce: after backward / waves {best['after']['exposed'] / w:.2f}x, "
          f"one wave / waves {best['onewave']['exposed'] / w:.2f}x")
PY
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
