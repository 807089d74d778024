#!/usr/bin/env bash
# pipeline_bench.sh — the FusionLLM figures (issue 14): time to reach a
# target validation loss with OP-Fence + AdaTopK against the same workers
# with an even split and no compression, over emulated WAN links of 1 Gbit,
# 100 Mbit and 10 Mbit; the final validation losses; the bytes the links
# carry per step with and without compression.
#
# The test bed (README, "Pipeline stages"): 4 stage workers on this host in
# two zones, interleaved as a naive scheduler would list them (a, b, a, b),
# worker 1 at half speed; 1 Gbit inside a zone, the WAN between zones, 5 ms
# one way. Links and speed are emulated in the transport (no netem, no
# cgroup quota here): a sender pays bytes/rate, a receiver sees a message
# 5 ms after it left, a slow worker sleeps off half of its compute.
#
# Two variants: the default AdaTopK floors (raw or dense bf16 per link,
# nothing dropped) and top-k allowed (gradient floor 0.05).
#
# Target: the baseline's validation loss at step N (both runs decay the
# learning rate over N steps, then hold min_lr); time: the sum of step
# times up to the first evaluation at or below it. Usage:
#   bench/pipeline_bench.sh [CORPUS] [SEEDS] [WAN_MBITS] [N]
set -euo pipefail
cd "$(dirname "$0")/.."
corpus=${1:-../shared/data/tinyshakespeare.txt}
seeds=${2:-"1 2 3"}
bws=${3:-"1000 100 10"}
N=${4:-60}
out=bench/out/pipeline
rm -rf "$out"
mkdir -p "$out"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build --target transom -j"$(nproc)" >/dev/null

cat > "$out/job.lua" <<EOF
return {
  model = "gpt", data = "$corpus", n_layer = 4, n_head = 4, n_embd = 64, block_size = 64, batch_size = 16,
  lr = 2e-3, min_lr = 2e-4, warmup_steps = 5, lr_decay_steps = $N, eval_interval = 5, eval_steps = 4,
  sample_tokens = 0, log_interval = 1000, threads = 4, checkpoint = { every_steps = 0 },
  pipeline = { stages = 4, micro_batches = 4, lan_mbit = 1000, wan_ms = 5,
    workers = { { zone = "a" }, { zone = "b", speed = 0.5 }, { zone = "a" }, { zone = "b" } } },
}
EOF

run() { # name bw seed steps placement compression [--set ...]
  build/transom run "$out/job.lua" --set run_dir="$out/$1" --set pipeline.wan_mbit="$2" --set seed="$3" \
    --set max_steps="$4" --set pipeline.placement="$5" --set pipeline.compression="$6" "${@:7}" > "$out/$1.log" 2>&1
}

for bw in $bws; do
  for seed in $seeds; do
    echo "wan ${bw} Mbit, seed ${seed}: baseline (even, no compression), OP-Fence + AdaTopK (default floors: raw or"\
      "bf16), OP-Fence + AdaTopK with top-k (gradient floor 0.05)"
    run "base-$bw-$seed" "$bw" "$seed" "$N" even none
    run "fusion-$bw-$seed" "$bw" "$seed" $((N * 3 / 2)) opfence adatopk
    run "topk-$bw-$seed" "$bw" "$seed" $((N * 3 / 2)) opfence adatopk --set pipeline.min_density=0.05
  done
done

python3 - "$out" "$N" "$bws" "$seeds" <<'EOF'
import json, sys, glob, os, statistics
out, N, bws, seeds = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(), sys.argv[4].split()

def zones(run):
    """stage -> zone, from the plan the launcher printed"""
    z = {}
    for line in open(os.path.join(out, run + ".log")):
        f = line.split()
        if len(f) >= 4 and f[0].isdigit() and f[1].isdigit() and f[3].isdigit():
            z[int(f[0])] = f[2]
    return z

def load(run):
    """step times, validation losses, and the mean bytes per step over the
    links that cross zones (the WAN), and over all links"""
    steps, vals, fwd, bwd = {}, {}, {}, {}
    for path in sorted(glob.glob(os.path.join(out, run, "*.jsonl"))):
        for line in open(path):
            r = json.loads(line)
            if "val_loss" in r:
                vals[r["step"]] = r["val_loss"]
            elif path.endswith("metrics.jsonl"):
                steps[r["step"]] = r["step_s"]
            if "bytes_fwd" in r and r["step"] > 2:
                fwd.setdefault(r["worker"], []).append(r["bytes_fwd"])
                bwd.setdefault(r["worker"], []).append(r["bytes_bwd"])
    z = zones(run)
    S = len(z)
    link = [statistics.mean(fwd[k]) + statistics.mean(bwd[k + 1]) for k in range(S - 1)]
    wan = sum(b for k, b in enumerate(link) if z[k] != z[k + 1])
    return steps, vals, (wan / 1e6, sum(link) / 1e6)

def time_to(steps, vals, target):
    for s in sorted(vals):
        if vals[s] <= target:
            return sum(t for k, t in steps.items() if k <= s), s
    return None, None

for variant in ("fusion", "topk"):
    print()
    print("=== %s vs baseline" % ("OP-Fence + AdaTopK (default floors)" if variant == "fusion"
                                  else "OP-Fence + AdaTopK with top-k (gradient floor 0.05)"))
    print("%8s %5s %10s %10s %8s %10s %10s %8s %8s %14s %14s" % ("WAN", "seed", "base s", "fusion s", "speedup",
          "base val", "fusion val", "val diff", "step x", "base MB/st", "fusion MB/st"))
    print("%8s %5s %10s %10s %8s %10s %10s %8s %8s %14s %14s" % ("", "", "", "", "", "", "", "", "",
          "(WAN / all)", "(WAN / all)"))
    summary = {}
    for bw in bws:
        for seed in seeds:
            bs, bv, bb = load("base-%s-%s" % (bw, seed))
            fs, fv, fb = load("%s-%s-%s" % (variant, bw, seed))
            target = bv[N]
            tb, _ = time_to(bs, bv, target)
            tf, _ = time_to(fs, fv, target)
            speed = tb / tf if tf else float("nan")
            vdiff = (fv[N] - bv[N]) / bv[N]
            med = lambda d: statistics.median([d[k] for k in d if 2 < k <= N])
            step_ratio = med(bs) / med(fs)
            print("%8s %5s %10.2f %10s %8.2f %10.4f %10.4f %+7.1f%% %8.2f %6.3f / %5.3f %6.3f / %5.3f" % (bw + "M",
                  seed, tb, "%.2f" % tf if tf else "never", speed, bv[N], fv[N], 100 * vdiff, step_ratio, bb[0], bb[1],
                  fb[0], fb[1]))
            summary.setdefault(bw, []).append((speed, vdiff, step_ratio, bb[0], fb[0]))
    print()
    for bw in bws:
        s = summary[bw]
        print("WAN %5s Mbit: time-to-target speedup %.2fx (median of %d seeds; nan: target not reached in %d steps), "
              "final val loss %+.1f%%, step speedup %.2fx, bytes per step over the WAN %.3f -> %.3f MB"
              % (bw, statistics.median([x[0] for x in s]), len(s), N * 3 // 2,
                 100 * statistics.median([x[1] for x in s]), statistics.median([x[2] for x in s]),
                 statistics.median([x[3] for x in s]), statistics.median([x[4] for x in s])))
EOF
