#!/usr/bin/env bash
# eagle_bench.sh — what watching a job costs and how fast it notices:
#   1. the overhead of metrics + rules on step time: the same 2-replica job
#      with the detector on and off, interleaved (on, off, on, off), median
#      step time of each, printed as a ratio;
#   2. detection latency per fault class, from the live-fault scenarios of
#      spec/eagle_spec.lua (NaN, straggler, SIGSTOP, hang, divergence).
#
#   bench/eagle_bench.sh [CORPUS]      env STEPS=400 TRANSOM=build/transom
set -euo pipefail
cd "$(dirname "$0")/.."
corpus=${1:-../shared/data/tinyshakespeare.txt}
STEPS=${STEPS:-400}
BIN=${TRANSOM:-build/transom}
out=${OUT:-bench/out/eagle}
rm -rf "$out" && mkdir -p "$out"
cat > "$out/job.lua" <<LUA
return { data = "$corpus", replicas = 2, max_steps = $STEPS, n_layer = 4, n_head = 4, n_embd = 128,
  block_size = 64, batch_size = 12, eval_interval = 0, eval_steps = 5, sample_tokens = 0, log_interval = 1000,
  checkpoint = { every_steps = 0, every_seconds = 0 }, checksum_interval = 10 }
LUA
for round in 1 2; do
  for mode in true false; do
    "$BIN" run "$out/job.lua" --set detector=$mode --set run_dir="$out/$mode-$round" > "$out/$mode-$round.log" 2>&1
  done
done
python3 - "$out" <<'PY'
import json, statistics, sys
out = sys.argv[1]
def steps(mode):
    ms = []
    for r in (1, 2):
        ms += [json.loads(l)["step_s"] * 1e3 for l in open(f"{out}/{mode}-{r}/metrics.jsonl") if '"worker"' in l]
    return statistics.median(ms)
on, off = steps("true"), steps("false")
print(f"median step time: detector on {on:.2f} ms, off {off:.2f} ms")
print(f"RATIO step_with_detector/step_without = {on / off:.3f}")
PY
echo "detection latency per fault class (live faults, spec/eagle_spec.lua):"
TRANSOM_BIN=$PWD/$BIN "$BIN" test spec/eagle_spec.lua 2>&1 | grep "detection latency" || echo "  (scenarios skipped: no corpus?)"
