#!/usr/bin/env bash
# ckpt_bench.sh — the checkpoint engine's ratios (bench/ckpt_bench.c) on the
# default model and on an 85M-parameter GPT (state 975 MiB: bigger than any
# cache), each against its baseline measured in the same run, with the
# machine described first (a shared machine moves every figure: compare the
# ratios of one run). Run as root for the cold-cache figures (the page cache
# is dropped). Usage: bench/ckpt_bench.sh [CORPUS] [SCRATCH_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
corpus=${1:-../shared/data/tinyshakespeare.txt}
scratch=${2:-bench/out/ckpt}
mkdir -p "$scratch"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build --target ckpt_bench -j"$(nproc)" >/dev/null
echo "=== machine: $(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')), \
$(free -g | awk '/^Mem:/ {print $2}') GiB RAM, scratch on $(df -h "$scratch" | awk 'NR==2 {print $1 " (" $2 ")"}'), \
load average $(cut -d' ' -f1-3 /proc/loadavg) at start"
echo
echo "=== default model (examples/fortunes.lua sizes), checkpoint every step"
build/ckpt_bench examples/fortunes.lua "$corpus" "$scratch"
echo
echo "=== 85M parameters (12 layers, 768 wide), checkpoint every step"
build/ckpt_bench examples/fortunes.lua "$corpus" "$scratch" --set n_layer=12 --set n_head=12 --set n_embd=768 \
  --set block_size=64 --set batch_size=2
echo
echo "=== load average $(cut -d' ' -f1-3 /proc/loadavg) at the end"
rm -rf "$scratch"
