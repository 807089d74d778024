#!/usr/bin/env bash
# pipeline_tc_bench.sh — the FusionLLM figures on test hosts (issue 14):
# time to a target validation loss with OP-Fence + AdaTopK (f) against
#   (a) the same pipeline workers with an even split and no compression, and
#   (b) plain data parallel over the same hosts and links,
# at 1 Gbit, 100 Mbit and 10 Mbit, and the bytes per step the links carry.
#
# The test bed: 4 test hosts (network namespaces, spec/hosts/testhosts.sh);
# host 4's link is limited with tc tbf to the WAN rate, hosts 1-3 to
# 1 Gbit (both ways; every flow to or from host 4 crosses its slow link).
# The pipeline's 4 stage workers are listed h1, h4, h2, h3, as a naive list
# would put them (the slow host second: an even split in that order crosses
# its link twice). (b) runs 4 replicas, one per host (`transom agent` on
# each, the operator on h1), each with a quarter of the batch: the same
# global batch, so step k of every run has seen the same number of tokens,
# and 16 evaluation batches of 4: the pipeline's 4 x 4 micro-batches, the
# same 64 validation sequences (the same seed draws them).
# All workers run at this host's speed (1 thread each); the heterogeneity is
# the links'. The kernel here has no netem: no added delay.
#
# Target: (a)'s validation loss at step N; time: the sum of the step times
# (stage 0's, or replica 0's) up to the first evaluation at or below it.
# Ratios come from runs made in the same script, one after the other.
# Needs root. Usage:
#   bench/pipeline_tc_bench.sh [CORPUS] [SEEDS] [WAN_MBITS] [N]
set -euo pipefail
cd "$(dirname "$0")/.."
corpus=$(realpath "${1:-../shared/data/tinyshakespeare.txt}")
seeds=${2:-"1 2 3"}
bws=${3:-"1000 100 10"}
N=${4:-60}
TH=spec/hosts/testhosts.sh
BIN=$(realpath build/transom)
out=$(realpath -m bench/out/pipeline_tc)
NAME=pt$$
NET=10.81.0
rm -rf "$out"
mkdir -p "$out"
$TH probe >/dev/null || { echo "pipeline_tc_bench: cannot make network namespaces here ($($TH probe))"; exit 77; }
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build --target transom -j"$(nproc)" >/dev/null
trap '$TH down $NAME >/dev/null 2>&1' EXIT

model="model = \"gpt\", data = \"$corpus\", n_layer = 4, n_head = 4, n_embd = 64, block_size = 64,
  lr = 2e-3, min_lr = 2e-4, warmup_steps = 5, lr_decay_steps = $N, eval_interval = 5,
  sample_tokens = 0, log_interval = 1000, checkpoint = { every_steps = 0, every_seconds = 0 }"
cat > "$out/pipe.lua" <<EOF
return { $model, batch_size = 16, eval_steps = 4, threads = 4,
  pipeline = { stages = 4, micro_batches = 4, workers = {
    { netns = "$NAME-h1", address = "$NET.1" }, { netns = "$NAME-h4", address = "$NET.4" },
    { netns = "$NAME-h2", address = "$NET.2" }, { netns = "$NAME-h3", address = "$NET.3" } } } }
EOF
cat > "$out/dp.lua" <<EOF
return { $model, batch_size = 4, eval_steps = 16, threads = 1, replicas = 4, hosts = 4, deadline = 30,
  hang_seconds = 120 }
EOF

links() { # wan rate in Mbit
  for k in 1 2 3; do $TH slow $NAME $k 1000mbit >/dev/null; done
  $TH slow $NAME 4 "$1mbit" >/dev/null
}

pipe() { # name seed steps placement compression
  "$BIN" run "$out/pipe.lua" --set run_dir="$out/$1" --set seed="$2" --set max_steps="$3" \
    --set pipeline.placement="$4" --set pipeline.compression="$5" > "$out/$1.log" 2>&1
}

dp() { # name seed steps
  local run=$out/$1 op k
  $TH exec $NAME 1 env MASTER_ADDR=$NET.1 MASTER_PORT=29500 "$BIN" run "$out/dp.lua" --set run_dir="$run" \
    --set seed="$2" --set max_steps="$3" > "$run.log" 2>&1 &
  op=$!
  for _ in $(seq 1 600); do [ -e "$run/secret" ] && break; sleep 0.05; done
  for k in 1 2 3 4; do
    ( $TH exec $NAME $k "$BIN" agent --operator $NET.1:29500 --secret-file "$run/secret" --name h$k --cores 1 \
      > "$run-agent$k.log" 2>&1 & )
  done
  wait $op || echo "data parallel run $1 failed: see $run.log"
  # the agents stop when their operator is gone; whatever is left on the
  # test hosts goes (testhosts.sh kill: that namespace's processes only; a
  # pkill would reach every transom agent on the machine)
  for k in 1 2 3 4; do $TH kill $NAME $k >/dev/null 2>&1 || true; done
}

$TH up $NAME 4 $NET >/dev/null
for bw in $bws; do
  links "$bw"
  for seed in $seeds; do
    echo "host 4 at $bw Mbit, seed $seed: (a) even split, no compression; (f) OP-Fence + AdaTopK; (b) data parallel"
    pipe "a-$bw-$seed" "$seed" "$N" even none
    pipe "f-$bw-$seed" "$seed" $((N * 3 / 2)) opfence adatopk
    dp "b-$bw-$seed" "$seed" $((N * 3 / 2))
  done
done

python3 - "$out" "$N" "$bws" "$seeds" <<'EOF'
import json, sys, os, statistics
out, N, bws, seeds = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(), sys.argv[4].split()

def load(run, worker=None):
    """step -> step time (one worker's), step -> validation loss, bytes per step (all stages' sends)"""
    steps, vals, sent = {}, {}, []
    path = os.path.join(out, run, "metrics.jsonl")
    for line in open(path):
        r = json.loads(line)
        if "val_loss" in r:
            vals[r["step"]] = r["val_loss"]
        elif worker is None or r.get("worker") == worker:
            steps.setdefault(r["step"], r["step_s"])
    for name in os.listdir(os.path.join(out, run)):
        if name.endswith(".jsonl") and (name.startswith("stage-") or name == "metrics.jsonl"):
            for line in open(os.path.join(out, run, name)):
                r = json.loads(line)
                if "bytes_fwd" in r and r["step"] > 2:
                    sent.append((r["step"], r["bytes_fwd"] + r["bytes_bwd"]))
    per_step = {}
    for s, b in sent:
        per_step[s] = per_step.get(s, 0) + b
    return steps, vals, statistics.mean(per_step.values()) / 1e6 if per_step else float("nan")

def time_to(steps, vals, target):
    for s in sorted(vals):
        if vals[s] <= target:
            return sum(t for k, t in steps.items() if k <= s)
    return None

print()
print("%6s %5s %9s %9s %9s %8s %8s %9s %9s %9s %11s %11s" % ("WAN", "seed", "(a) s", "(f) s", "(b) s", "a/f", "b/f",
      "(a) val", "(f) val", "val diff", "(a) MB/st", "(f) MB/st"))
summary = {}
for bw in bws:
    for seed in seeds:
        a_s, a_v, a_b = load("a-%s-%s" % (bw, seed))
        f_s, f_v, f_b = load("f-%s-%s" % (bw, seed))
        try:
            b_s, b_v, _ = load("b-%s-%s" % (bw, seed), worker=0)
        except OSError:
            b_s, b_v = {}, {}
        target = a_v[N]
        ta, tf, tb = time_to(a_s, a_v, target), time_to(f_s, f_v, target), time_to(b_s, b_v, target)
        af = ta / tf if tf else float("nan")
        bf = tb / tf if tf and tb else float("nan")
        vdiff = (f_v[N] - a_v[N]) / a_v[N]
        fmt = lambda t: "%.2f" % t if t else "never"
        print("%6s %5s %9.2f %9s %9s %8.2f %8.2f %9.4f %9.4f %+8.1f%% %11.3f %11.3f" % (bw + "M", seed, ta, fmt(tf),
              fmt(tb), af, bf, a_v[N], f_v[N], 100 * vdiff, a_b, f_b))
        summary.setdefault(bw, []).append((af, bf, vdiff, a_b, f_b))
print()
for bw in bws:
    s = summary[bw]
    med = lambda i: statistics.median([x[i] for x in s])
    print("host 4 at %5s Mbit: time to target, OP-Fence + AdaTopK vs (a) even/uncompressed %.2fx, vs (b) data "
          "parallel %.2fx (medians of %d seeds; nan: target not reached in %d steps); final val loss vs (a) %+.1f%%; "
          "bytes per step %.3f -> %.3f MB" % (bw, med(0), med(1), len(s), N * 3 // 2, 100 * med(2), med(3), med(4)))
EOF
