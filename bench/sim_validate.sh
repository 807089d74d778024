#!/usr/bin/env bash
# sim_validate.sh — does `transom sim` predict what bench/operator_bench.sh
# measures? Runs the bench (a replica killed every K steps, in transom's
# replace mode and with restart_all), measures on this machine the costs the
# simulator takes (step times, start-up, survivors' stall, a replacement's
# start and catch-up, a restart, checkpoint commits), writes them into a
# scenario per mode (bench/out/operator/sim-*.lua, each number with where it
# came from), runs the simulator on it and prints both ETTRs side by side.
# Target: within 5 points.
#
#   bench/sim_validate.sh [CORPUS]
#   env STEPS=500 K=50 CKPT=25 REPLICAS=2 (passed to operator_bench.sh)
#       SKIP_BENCH=1: reuse the runs already in bench/out/operator
#
# operator_bench.sh's ETTR is steps x the clean run's median step time / wall
# time, so the machine's load moves it (this 2-core machine is shared: step
# times drift by +-30% between runs). Here each run's ETTR is its steps at its
# own fault-free step time (mean of its steps with every replica live) over
# its wall time, and the simulator gets that same step time: it predicts
# what the failures add on top (redone steps, stalls, restarts, time with a
# replica missing), and the difference is its wall time against the run's.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${TRANSOM:-build/transom}
export OUT=${OUT:-bench/out/operator}
export STEPS=${STEPS:-500} K=${K:-50} CKPT=${CKPT:-25} REPLICAS=${REPLICAS:-2}
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  bench/operator_bench.sh "$@"
fi

python3 - "$OUT" "$BIN" "$STEPS" "$K" "$CKPT" "$REPLICAS" <<'PY'
import json, re, statistics, subprocess, sys
out, binary, steps, K, ckpt, R = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])

def wall(name):
    a, b = map(float, open(f"{out}/{name}.wall").read().split())
    return b - a
def metrics(name):
    return [json.loads(l) for l in open(f"{out}/{name}/metrics.jsonl") if '"worker"' in l]
def events(name):
    return [json.loads(l) for l in open(f"{out}/{name}/events.jsonl")]
def mean(xs, default=0.0):
    xs = list(xs)
    return statistics.mean(xs) if xs else default

# --- what the bench measured: see useful() below ---

# --- the costs, each from where it shows ---
cost, src = {}, {}
def put(key, value, where):
    cost[key], src[key] = value, where

# the transom run's steps next to a kill or a join are the survivors' stall
# (redo_s, join_s below), not step time
stalled = {e["step"] + d for e in events("transom") for d in range(4)
           if e["kind"] == "replica_failed" or (e["kind"] == "replica_ready" and "join" in e["detail"])}
step_full = {n: mean(r["step_s"] for r in metrics(n) if r["replicas"] == R and (n != "transom" or r["step"] not in stalled))
             for n in ("clean", "transom", "restart_all")}
alone = [r["step_s"] for r in metrics("transom") if r["replicas"] < R and r["step"] not in stalled]
put("degraded_step_s", mean(alone, step_full["transom"]),
    f"transom run: mean of its {len(alone)} step records with a replica missing")
put("startup_s", wall("clean") - steps * step_full["clean"],
    "clean run: wall time - steps x its mean step time (process start, final save and exit)")
commits = [float(m.group(1)) / 1e3 for e in events("clean") if e["kind"] == "checkpoint"
           for m in [re.search(r"in ([\d.]+) ms", e["detail"])] if m]
put("write_s", mean(commits), f"clean run: mean of {len(commits)} checkpoint commits (events.jsonl)")

# transom mode: the survivors' stall around each kill (as operator_bench.sh
# computes it) and around each join; a replacement's start and catch-up
ev = events("transom")
rows = metrics("transom")
med = statistics.median(r["step_s"] for r in rows)
by = {}
for r in rows:
    by.setdefault(r["worker"], {})[r["step"]] = r["step_s"]
def survivors_extra(step, victim):
    extra = []
    for w, st in by.items():
        if w == victim:
            continue
        near = [st[s] for s in range(step, step + 4) if s in st]
        if near:
            extra.append(sum(max(0.0, x - med) for x in near))
    return max(extra) if extra else 0.0
fails = [e for e in ev if e["kind"] == "replica_failed"]
readys = [e for e in ev if e["kind"] == "replica_ready" and "join" in e["detail"]]
put("redo_s", mean(survivors_extra(e["step"], e["worker"]) for e in fails),
    f"transom run: survivors' extra step time in the 4 steps from each of {len(fails)} kills (operator_bench.sh's stall)")
put("join_s", mean(survivors_extra(e["step"], e["worker"]) for e in readys),
    f"transom run: the same from each of {len(readys)} joins")
spawn = {}
start, catch = [], []
for e in ev:
    if e["kind"] == "spawn" and "join" in e["detail"]:
        spawn[e["worker"]] = e["time"]
    elif e["kind"] == "replica_joining" and e["worker"] in spawn:
        start.append(e["time"] - spawn[e["worker"]])
        joining = e["time"]
    elif e["kind"] == "replica_ready" and "join" in e["detail"] and e["worker"] in spawn:
        catch.append(e["time"] - joining)
put("start_s", mean(start), f"transom run: spawn -> catching up, mean of {len(start)}")
put("catchup_s", mean(catch), f"transom run: catching up -> ready, mean of {len(catch)}")
put("detect_s", 0.0, "a kill -9 is seen at once (EOF; ftar_vs_mpi.sh: survivors redo 28.5 ms after it)")

# restart_all: from the failure until every replica is ready again
ev = events("restart_all")
restarts, t_fail, ready = [], None, set()
for e in ev:
    if e["kind"] == "restart_all":
        t_fail, ready = e["time"], set()
    elif e["kind"] == "replica_ready" and t_fail is not None:
        ready.add(e["worker"])
        if len(ready) == R:
            restarts.append(e["time"] - t_fail)
            t_fail = None
put("restart_s", mean(restarts), f"restart_all run: restart_all event -> every replica ready, mean of {len(restarts)}")

# A run's useful time: its steps at its own fault-free step time (the mean of
# its steps with every replica live, away from a kill or a join). The clean
# run's step time would do on a quiet machine; on a shared one the load moves
# between runs (step times +-30%, once 2.4x), and that would read as failures.
# Measured and simulated ETTR share this numerator, so their difference is
# the simulator's wall time against the run's.
def useful(run):
    return steps * step_full[run]
measured = {n: useful(n) / wall(n) for n in ("transom", "restart_all")}

chaos = []
s, r = K, 1
while s < steps:
    chaos.append(f"{{ at_step = {s}, replica = {r} }}")
    s, r = s + K, (r + 1) % R

def scenario(path, step_s, degraded):
    c = cost
    with open(path, "w") as f:
        f.write(f"""-- {path}: written by bench/sim_validate.sh from the runs in {out}/.
-- Every cost was measured on this machine (comments: where); the restart
-- policy's delays are lua/policies/restart.lua's.
return {{
  seeds = 1,
  job = {{
    gpus_per_replica = 1, gpus_per_host = 1, replicas = {R}, steps = {steps},
    step_s = {step_s:.6f}, -- mean step time with every replica live
    degraded_step_s = {degraded:.6f}, -- {src['degraded_step_s']}
    startup_s = {c['startup_s']:.4f}, -- {src['startup_s']}
  }},
  failures = {{
    hardware_fraction = 0, -- kill -9 of a process: it restarts on the same host
    chaos = {{ {", ".join(chaos)} }}, -- operator_bench.sh's kills
    detect_s = {c['detect_s']:.4f}, -- {src['detect_s']}
  }},
  checkpoint = {{
    every_steps = {ckpt}, -- operator_bench.sh's CKPT
    stall_s = 0, -- the snapshot's wait is inside the measured step time (ckpt_wait_s)
    write_s = {c['write_s']:.4f}, -- {src['write_s']}
    load_s = 0, -- inside restart_s
  }},
  replace = {{
    redo_s = {c['redo_s']:.4f}, -- {src['redo_s']}
    delay_s = 0.2, backoff = 2, delay_max_s = 10, -- lua/policies/restart.lua
    start_s = {c['start_s']:.4f}, -- {src['start_s']}
    catchup_s = {c['catchup_s']:.4f}, -- {src['catchup_s']}
    join_s = {c['join_s']:.4f}, -- {src['join_s']}
  }},
  restart_all = {{
    restart_s = {c['restart_s']:.4f}, -- {src['restart_s']}
  }},
}}
""")

def simulate(path, mode):
    res = subprocess.run([binary, "sim", path], capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit(f"sim_validate: transom sim {path}: {res.stderr.strip()}")
    for line in res.stdout.splitlines():
        if line.startswith(f"result mode={mode} "):
            kv = dict(x.split("=") for x in line.split()[1:])
            return float(kv["wall_s"])
    sys.exit(f"sim_validate: no result for {mode} in the output of transom sim {path}")

print()
print("costs measured on this machine (fed to the simulator):")
for n in ("clean", "transom", "restart_all"):
    print(f"  step time, all {R} live, {n:11s}  {step_full[n] * 1e3:7.1f} ms")
for k in ("degraded_step_s", "startup_s", "write_s", "detect_s", "redo_s", "join_s", "start_s", "catchup_s", "restart_s"):
    print(f"  {k:16s} {cost[k]:8.3f} s   {src[k]}")

modes = (("transom", "replace"), ("restart_all", "restart_all"))
pred, sim_wall = {}, {}
for run, mode in modes:
    own = f"{out}/sim-{run}.lua"
    scenario(own, step_full[run], cost["degraded_step_s"] * step_full[run] / step_full["transom"])
    sim_wall[run] = simulate(own, mode)
    pred[run] = useful(run) / sim_wall[run]

print()
print(f"ETTR, {R} replicas, {steps} steps, a replica killed every {K} steps, checkpoints every {ckpt}")
print("(useful time: each run's steps at its own fault-free step time):")
print(f"{'mode':12s} {'measured':>9s} {'simulated':>10s} {'difference':>11s}   {'wall':>7s} {'simulated wall':>15s}")
worst = 0.0
for run, _ in modes:
    d = 100 * (pred[run] - measured[run])
    worst = max(worst, abs(d))
    print(f"{run:12s} {measured[run]:9.3f} {pred[run]:10.3f} {d:+9.1f} pts   {wall(run):6.1f}s {sim_wall[run]:14.1f}s")
print(f"RATIO measured/simulated transom/restart_all = "
      f"{measured['transom'] / measured['restart_all']:.2f} / {pred['transom'] / pred['restart_all']:.2f}")
print(f"worst difference {worst:.1f} points (target <= 5): {'met' if worst <= 5 else 'NOT met'}")
PY
