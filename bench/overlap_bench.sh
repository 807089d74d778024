#!/usr/bin/env bash
# overlap_bench.sh — data-parallel training with the gradient all-reduce
# overlapped with backward (bucket_mb) against the one all-reduce after
# backward (bucket_mb = 0), and 2 replicas x 1 thread against 1 replica x 2
# threads on the same cores, in one script. Prints per run the median step
# time, tokens/s (all replicas), the exposed all-reduce (what the step waited
# for: allreduce_s) and its share of the step, the all-reduce's own time
# (comm_s); then the ratios: exposed share after / before the overlap, and
# the data-parallel scaling tokens/s(2 x 1 thread) / tokens/s(1 x 2 threads).
#
#   bench/overlap_bench.sh [CORPUS]
#   env STEPS=150 ROUNDS=3 BUCKETS="0 0.25 0.5 1 2" TRANSOM=build/transom
#
# Medians over the steps after the first 20 (start-up, caches); every
# configuration runs ROUNDS times, interleaved, and the best round counts
# (the machine this was written on has 2 cores that other jobs share: load
# moves a run by 2x; interleaving and best-of keep the ratios within a run
# meaningful). Take ratios from one invocation, not across invocations.
set -euo pipefail
cd "$(dirname "$0")/.."
corpus=${1:-../shared/data/tinyshakespeare.txt}
STEPS=${STEPS:-150}
ROUNDS=${ROUNDS:-3}
BUCKETS=${BUCKETS:-"0 0.25 0.5 1 2"}
BIN=${TRANSOM:-build/transom}
out=${OUT:-bench/out/overlap}
[ -n "${SKIP_RUNS:-}" ] || { rm -rf "$out" && mkdir -p "$out"; }

run() { # name replicas threads bucket_mb (one replica: none; it has no all-reduce, and refuses the key)
  local bucket=()
  [ "$2" -gt 1 ] && bucket=(--set bucket_mb="$4")
  "$BIN" run examples/shakespeare.lua --set data="$corpus" --set run_dir="$out/$1" --set replicas="$2" \
    --set threads="$3" "${bucket[@]}" --set max_steps="$STEPS" --set eval_interval=0 \
    --set sample_tokens=0 --set log_interval=1000 --set detector=false > "$out/$1.log" 2>&1
}

if [ -z "${SKIP_RUNS:-}" ]; then
  for ((i = 0; i < ROUNDS; i++)); do
    run "single.$i" 1 2 -
    for b in $BUCKETS; do run "dp_b$b.$i" 2 1 "$b"; done
  done
fi

python3 - "$out" "$BUCKETS" "$ROUNDS" <<'PY'
import json, statistics as st, sys
out, buckets, rounds = sys.argv[1], sys.argv[2].split(), int(sys.argv[3])
def summary(name): # the best round by tokens/s
    return max((round_summary(f"{name}.{i}") for i in range(rounds)), key=lambda x: x[1])
def round_summary(name):
    rows = [json.loads(l) for l in open(f"{out}/{name}/metrics.jsonl") if "\"step_s\"" in l]
    by = {}
    for r in rows:
        if r["step"] > 20: by.setdefault(r["step"], []).append(r)
    steps = [v for v in by.values()]
    med = lambda f: st.median(f(v) for v in steps)
    step_s = med(lambda v: max(r["step_s"] for r in v))
    tok = med(lambda v: sum(r["tokens_per_s"] for r in v))
    exp = med(lambda v: st.mean(r["allreduce_s"] for r in v))
    comm = med(lambda v: st.mean(r.get("comm_s") or 0 for r in v))
    return step_s, tok, exp, comm
print(f"{'run':<22}{'step ms':>9}{'tokens/s':>10}{'exposed ms':>12}{'share':>8}{'comm ms':>9}")
res = {}
for name, label in [("single", "1 x 2 threads")] + [(f"dp_b{b}", f"2 x 1, bucket_mb={b}") for b in buckets]:
    s, t, e, c = res[name] = summary(name)
    print(f"{label:<22}{s*1e3:>9.1f}{t:>10.0f}{e*1e3:>12.1f}{e/s:>8.3f}{c*1e3:>9.1f}")
base = res["dp_b0"]
print()
for b in buckets:
    if b == "0": continue
    s, t, e, c = res[f"dp_b{b}"]
    print(f"bucket_mb={b}: exposed share {e/s:.3f} vs {base[2]/base[0]:.3f} after backward "
          f"(x{(e/s)/(base[2]/base[0]):.2f}); tokens/s x{t/base[1]:.3f}")
best = max((b for b in buckets if b != "0"), key=lambda b: res[f"dp_b{b}"][1])
print(f"data-parallel scaling, tokens/s 2 x 1 thread / 1 x 2 threads: {base[1]/res['single'][1]:.3f} after backward, "
      f"{res[f'dp_b{best}'][1]/res['single'][1]:.3f} overlapped (bucket_mb={best})")
PY
