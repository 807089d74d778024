#!/usr/bin/env bash
# ckpt_bench.sh — the checkpoint engine's four ratios (bench/ckpt_bench.c) on
# the default model and on a ~100M-parameter GPT (state ~1.2 GB: bigger than
# any cache). Usage: bench/ckpt_bench.sh [CORPUS] [SCRATCH_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
corpus=${1:-../shared/data/tinyshakespeare.txt}
scratch=${2:-bench/out/ckpt}
mkdir -p "$scratch"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build --target ckpt_bench -j"$(nproc)" >/dev/null
echo "=== default model (examples/fortunes.lua sizes), checkpoint every step"
build/ckpt_bench examples/fortunes.lua "$corpus" "$scratch"
echo
echo "=== ~100M parameters (12 layers, 768 wide), checkpoint every step"
build/ckpt_bench examples/fortunes.lua "$corpus" "$scratch" --set n_layer=12 --set n_head=12 --set n_embd=768 \
  --set block_size=64 --set batch_size=2
rm -rf "$scratch"
