#!/usr/bin/env bash
# gpu_vs_torch.sh — transom's CUDA backend against PyTorch eager and
# torch.compile on the same GPU, in one script; then the checkpoint stall on
# the GPU against a synchronous save (download + write + fsync).
#
#   bench/gpu_vs_torch.sh [CORPUS]
#
#   CORPUS   training text (default: ../shared/data/tinyshakespeare.txt)
#   env STEPS=30           steps per run (the first WARMUP are not timed)
#   env WARMUP=5           untimed steps (torch.compile compiles in them)
#   env TRANSOM=build/transom   (built with the CUDA plugin beside it)
#   env PYTHON=python3     a python with a CUDA build of torch
#   env TORCH_MODES="eager compile"  which torch runs to make (eager is the
#                          target; compile costs a minute of compiling)
#   env PEAK_TFLOPS=...    the GPU's dense peak for MFU (default for H100/H200
#                          SXM: 67 for fp32, 989 for bf16; else required)
#   env PRECISION=fp32     or bf16: transom precision=bf16 against torch
#                          autocast(bfloat16), both with fp32 master weights
#   env SIZE="--set n_layer=12 ..."  the model (default: GPT-2 124M shapes,
#                          B=8, T=1024; byte tokens, so the vocabulary is the
#                          corpus's distinct bytes, not 50257)
#
# PRECISION=fp32 (default): fp32 on both sides (torch's default: no TF32 in
# matmuls; transom's cuBLAS default math). It prints tokens/s, MFU and the ratios; no
# thresholds. Without a GPU it says so and exits 2.
set -euo pipefail

CALLER_PWD=$PWD
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
DATA=${1:-../shared/data/tinyshakespeare.txt}
if [ $# -ge 1 ] && [[ "$DATA" != /* ]]; then DATA="$CALLER_PWD/$DATA"; fi
STEPS=${STEPS:-30}
PRECISION=${PRECISION:-fp32}
TORCH_PREC=""; [ "$PRECISION" = bf16 ] && TORCH_PREC="--bf16"
WARMUP=${WARMUP:-5}
TRANSOM=${TRANSOM:-build/transom}
PYTHON=${PYTHON:-python3}
OUT=${OUT:-bench/out/gpu}
L=12 NH=12 C=768 T=1024 B=8
SIZE=${SIZE:-"--set n_layer=$L --set n_head=$NH --set n_embd=$C --set block_size=$T --set batch_size=$B"}
mkdir -p "$OUT"

[ -f "$DATA" ] || { echo "gpu_vs_torch: no corpus at $DATA" >&2; exit 2; }
if ! nvidia-smi -L >/dev/null 2>&1; then echo "gpu_vs_torch: no GPU visible (nvidia-smi -L failed); nothing measured" >&2; exit 2; fi
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
if [ -z "${PEAK_TFLOPS:-}" ]; then
  case "$GPU:$PRECISION" in  # dense peaks (SXM): fp32 67, bf16 tensor cores 989
    *H100*:fp32|*H200*:fp32) PEAK_TFLOPS=67 ;; *H100*:bf16|*H200*:bf16) PEAK_TFLOPS=989 ;;
    *) echo "gpu_vs_torch: set PEAK_TFLOPS for $GPU ($PRECISION)" >&2; exit 2 ;;
  esac
fi
[ -x "$TRANSOM" ] || { echo "gpu_vs_torch: no transom binary at $TRANSOM" >&2; exit 2; }
[ -f "$(dirname "$TRANSOM")/libtransom_cuda.so" ] || { echo "gpu_vs_torch: no CUDA plugin beside $TRANSOM" >&2; exit 2; }
echo "== $GPU | $PRECISION | peak $PEAK_TFLOPS TFLOP/s | $STEPS steps ($WARMUP warm-up) | $SIZE"

# transom: per-step times from metrics.jsonl, steps WARMUP+1..STEPS, like torch's
rm -rf "$OUT/run"
"$TRANSOM" run examples/shakespeare.lua --set data="$DATA" --set device=cuda --set precision="$PRECISION" $SIZE --set max_steps="$STEPS" \
  --set eval_interval=0 --set sample_tokens=0 --set log_interval=10 --set checkpoint.every_steps=0 --set checkpoint.every_seconds=0 \
  --set run_dir="$OUT/run" 2>&1 | tee "$OUT/transom.log"
tr_tok=$(awk -v w="$WARMUP" -v bt=$((B * T)) '
  /"loss":/ { s = $0; sub(/.*"step":/, "", s); sub(/,.*/, "", s); m = $0; sub(/.*"step_s":/, "", m); sub(/,.*/, "", m); m *= 1000
              if (s + 0 > w) { t += m; n++ } }
  END { if (t > 0) printf "%.1f", n * bt / (t / 1000) }' "$OUT/run/metrics.jsonl")

TORCH_MODES=${TORCH_MODES:-eager compile}
rm -f "$OUT/torch-eager.log" "$OUT/torch-compile.log"
for mode in $TORCH_MODES; do
  extra=""; [ "$mode" = compile ] && extra="--compile"
  "$PYTHON" bench/torch_gpt.py --device cuda $extra $TORCH_PREC --data "$DATA" --steps "$STEPS" --warmup "$WARMUP" \
    --n-layer $L --n-head $NH --n-embd $C --block-size $T --batch-size $B --log-interval 10 2>&1 | tee "$OUT/torch-$mode.log"
done
val() { [ -f "$2" ] && sed -n "s/^$1=//p" "$2"; }
echo
echo "== results (tokens/s over steps $((WARMUP + 1))..$STEPS; FLOPs per token as both sides count them: 6N + attention)"
awk -v a="$tr_tok" -v e="$(val torch_tok_s "$OUT/torch-eager.log")" -v c="$(val torch_tok_s "$OUT/torch-compile.log")" \
    -v ge="$(val torch_gflop_s "$OUT/torch-eager.log")" -v gc="$(val torch_gflop_s "$OUT/torch-compile.log")" \
    -v p="$PEAK_TFLOPS" 'BEGIN {
  if (e <= 0) { print "torch eager made no figure: see torch-eager.log"; exit }
  fpt = ge * 1e9 / e  # FLOPs per token
  printf "transom cuda    %10.0f tok/s | MFU %5.1f%%\n", a, 100 * a * fpt / (p * 1e12)
  printf "torch eager     %10.0f tok/s | MFU %5.1f%%\n", e, 100 * ge / (p * 1000)
  if (c > 0) printf "torch.compile   %10.0f tok/s | MFU %5.1f%%\n", c, 100 * gc / (p * 1000)
  printf "RATIO transom/torch_eager = %.3f (target >= 1.0)\n", a / e
  if (c > 0) printf "RATIO transom/torch_compile = %.3f\n", a / c }'

echo
echo "== checkpoint stall on the GPU (bench/ckpt_bench.c, a checkpoint every step)"
cmake --build "$(dirname "$TRANSOM")" --target ckpt_bench >/dev/null
"$(dirname "$TRANSOM")/ckpt_bench" examples/shakespeare.lua "$DATA" "$OUT/ckpt" --set device=cuda \
  --set precision="$PRECISION" $SIZE
rm -rf "$OUT/ckpt" "$OUT/run"
