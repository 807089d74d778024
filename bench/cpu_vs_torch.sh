#!/usr/bin/env bash
# cpu_vs_torch.sh — transom vs PyTorch eager (CPU) on the same GPT training
# step, plus OpenBLAS sgemm as the ceiling for the step's matmuls.
#
#   bench/cpu_vs_torch.sh [CORPUS] [THREADS]
#
#   CORPUS   training text (default: ../shared/data/tinyshakespeare.txt,
#            relative to the repository root)
#   THREADS  compute threads for all three (default: nproc)
#   env STEPS=200          steps for transom and for torch (timed: 2..STEPS)
#   env REPEAT=1           rounds of (transom, torch), alternating; the best
#                          round of each counts (for a machine shared with others)
#   env TRANSOM=build/transom
#   env OUT=bench/out      sgemm binary, transom run directory, logs
#   env PYTHON=...         a python that has torch (skips the venv)
#
# Config: examples/shakespeare.lua (4 layers, 4 heads, 128 wide, block 64,
# batch 12), the same for both. It only prints; no thresholds.
#
# Torch: used from $PYTHON, else from python3 if it imports torch, else from
# bench/.venv (git-ignored), which this script makes and fills:
#   1. pip install --index-url https://download.pytorch.org/whl/cpu torch
#      (the small CPU-only wheel; short timeout — usually unreachable here);
#   2. pip install --no-deps torch from PyPI plus its pure-python deps, then
#      `import torch` is tried (PyPI's Linux wheel is the CUDA build: as of
#      torch 2.15 this import fails with "libcufile.so.0: cannot open shared
#      object file", its CUDA libraries being separate packages);
#   3. pip install torch from PyPI with its dependencies (cuda-toolkit,
#      nvidia-* ... several GB; the CPU path works with them present and no GPU).
set -euo pipefail

CALLER_PWD=$PWD
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

DATA=${1:-../shared/data/tinyshakespeare.txt}
if [ $# -ge 1 ] && [[ "$DATA" != /* ]]; then DATA="$CALLER_PWD/$DATA"; fi
THREADS=${2:-$(nproc)}
STEPS=${STEPS:-200}
REPEAT=${REPEAT:-1}
TRANSOM=${TRANSOM:-build/transom}
OUT=${OUT:-bench/out}
VENV=bench/.venv
[ -f "$DATA" ] || { echo "cpu_vs_torch: no corpus at $DATA" >&2; exit 2; }
[ -x "$TRANSOM" ] || { echo "cpu_vs_torch: no transom binary at $TRANSOM (build it first)" >&2; exit 2; }
[ "$STEPS" -ge 2 ] || { echo "cpu_vs_torch: STEPS must be >= 2" >&2; exit 2; }
mkdir -p "$OUT"
LOAD0=$(cut -d' ' -f1-3 /proc/loadavg)

# --- torch -----------------------------------------------------------------
has_torch() { "$1" -c 'import torch' >/dev/null 2>&1; }

install_torch() {
  local t0=$SECONDS pip="$VENV/bin/pip" how=""
  echo "== installing torch into $VENV"
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  if timeout 120 "$pip" install --timeout 15 --retries 0 \
       --index-url https://download.pytorch.org/whl/cpu torch >"$OUT/pip-cpu-index.log" 2>&1 &&
     has_torch "$VENV/bin/python"; then
    how="CPU wheel from download.pytorch.org/whl/cpu"
  else
    echo "   download.pytorch.org CPU index failed: $(grep -m1 ERROR "$OUT/pip-cpu-index.log" || echo timeout)"
    if "$pip" install --no-deps torch >"$OUT/pip-nodeps.log" 2>&1 &&
       "$pip" install filelock typing-extensions sympy networkx jinja2 fsspec 'setuptools>=77.0.3' numpy \
         >>"$OUT/pip-nodeps.log" 2>&1 &&
       has_torch "$VENV/bin/python"; then
      how="PyPI torch --no-deps + pure-python deps (no CUDA libraries)"
    else
      echo "   PyPI torch --no-deps: import fails: $("$VENV/bin/python" -c 'import torch' 2>&1 | tail -1)"
      echo "   installing PyPI torch with its CUDA dependencies (several GB)"
      "$pip" install torch numpy >"$OUT/pip-full.log" 2>&1 || { tail -20 "$OUT/pip-full.log" >&2; exit 1; }
      has_torch "$VENV/bin/python" || { "$VENV/bin/python" -c 'import torch' >&2; exit 1; }
      how="PyPI torch with dependencies (CUDA build, run on CPU)"
    fi
  fi
  echo "   torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)'): $how;" \
       "install took $((SECONDS - t0)) s, venv $(du -sh "$VENV" | cut -f1)"
}

if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
elif has_torch python3; then
  PY=python3
else
  has_torch "$VENV/bin/python" || install_torch
  PY=$VENV/bin/python
fi

# --- sgemm -----------------------------------------------------------------
echo "== OpenBLAS sgemm ($THREADS threads)"
gcc -O2 bench/sgemm.c -o "$OUT/sgemm" $(pkg-config --cflags --libs openblas)
"$OUT/sgemm" "$THREADS" | tee "$OUT/sgemm.log"

kv() { sed -n "s/^$1=//p" "$2" | tail -1; }
best() { printf '%s\n' "$@" | sort -g | tail -1; } # largest of the rounds' figures

# --- transom and torch, REPEAT rounds (alternating; the best round counts) ---
RUN="$OUT/transom_run"
EXTRA=()
# Checkpoints off: the step alone is compared (torch saves nothing either).
if "$TRANSOM" run --help 2>&1 | grep -q 'checkpoint'; then EXTRA+=(--set checkpoint.every_steps=0 --set checkpoint.every_seconds=0); fi
T_TOKS=() T_GFS=() T_MEDS=() P_TOKS=() P_GFS=() P_MEDS=()
for ((r = 1; r <= REPEAT; r++)); do
  echo "== transom: $STEPS steps, $THREADS threads (round $r/$REPEAT)"
  rm -rf "$RUN"
  "$TRANSOM" run examples/shakespeare.lua --set "data=$DATA" --set "max_steps=$STEPS" --set "threads=$THREADS" \
    --set "run_dir=$RUN" --set eval_interval=0 --set sample_tokens=0 --set "log_interval=$STEPS" "${EXTRA[@]}" \
    | tee "$OUT/transom.log"
  DONE=$(grep '^done:' "$OUT/transom.log" | tail -1)
  T_TOKS+=("$(sed -n 's/.*| \([0-9.]*\) tok\/s |.*/\1/p' <<<"$DONE")")
  T_GFS+=("$(sed -n 's/.*| \([0-9.]*\) GFLOP\/s.*/\1/p' <<<"$DONE")")
  T_MEDS+=("$("$PY" -c '
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if "\"tokens_per_s\"" in l]
st = sorted(r["step_s"] for r in rows if r["step"] > 1)
print("%.1f" % (rows[0]["tokens_per_s"] * rows[0]["step_s"] / st[len(st) // 2]))' "$RUN/metrics.jsonl")")
  T_PARAMS=$(sed -n 's/^model [^:]*: \([0-9]*\) parameters.*/\1/p' "$OUT/transom.log")

  echo "== torch eager: $STEPS steps, $THREADS threads (round $r/$REPEAT)"
  "$PY" bench/torch_gpt.py --data "$DATA" --threads "$THREADS" --steps "$STEPS" --log-interval "$STEPS" \
    --check-safetensors "$RUN/model.safetensors" | tee "$OUT/torch.log"
  P_TOKS+=("$(kv torch_tok_s "$OUT/torch.log")")
  P_GFS+=("$(kv torch_gflop_s "$OUT/torch.log")")
  P_MEDS+=("$(kv torch_median_tok_s "$OUT/torch.log")")
done
T_TOK=$(best "${T_TOKS[@]}") T_GF=$(best "${T_GFS[@]}") T_MED=$(best "${T_MEDS[@]}")
P_TOK=$(best "${P_TOKS[@]}") P_GF=$(best "${P_GFS[@]}") P_MED=$(best "${P_MEDS[@]}")

# --- summary ---------------------------------------------------------------
S_MIX=$(kv sgemm_step_mix_gflop_s "$OUT/sgemm.log")
S_1024=$(kv sgemm_1024_gflop_s "$OUT/sgemm.log")
S_UP=$(sed -n 's/^sgemm_[0-9]*x[0-9]*x[0-9]*_gflop_s=//p' "$OUT/sgemm.log")
echo
echo "== summary: examples/shakespeare.lua config, $STEPS steps (timed 2..$STEPS), $THREADS threads," \
     "best of $REPEAT round(s)"
[ "$REPEAT" -gt 1 ] && echo "rounds: transom tok/s ${T_TOKS[*]} | torch tok/s ${P_TOKS[*]}"
echo "parameters: transom $T_PARAMS (slab, 64-byte padded) | unpadded $(kv transom_params_unpadded "$OUT/torch.log")" \
     "| torch $(kv torch_params "$OUT/torch.log") | match: $(kv params_match "$OUT/torch.log")"
echo "load average at start: $LOAD0 (other work on the machine skews every figure below)"
awk -v t="$T_TOK" -v p="$P_TOK" -v tm="$T_MED" -v pm="$P_MED" -v tg="$T_GF" -v pg="$P_GF" -v mix="$S_MIX" \
    -v sq="$S_1024" -v up="$S_UP" -v ver="$(kv torch_version "$OUT/torch.log")" 'BEGIN {
  printf "transom tok/s = %.0f\n", t
  printf "torch   tok/s = %.0f (torch %s eager)\n", p, ver
  printf "transom/torch = %.2fx (target >= 1.5x)\n", t / p
  printf "median step: transom %.0f tok/s | torch %.0f tok/s | transom/torch = %.2fx\n", tm, pm, tm / pm
  printf "GFLOP/s: transom step %.2f | torch step %.2f | sgemm step-mix %.2f | sgemm 768x512x128 %.2f | sgemm 1024^3 %.2f\n", tg, pg, mix, up, sq
  printf "transom step / sgemm step-mix = %.2f | transom step / sgemm 1024^3 = %.2f\n", tg / mix, tg / sq
}'
