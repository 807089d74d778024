#!/usr/bin/env bash
# gpu_check.sh — on a lent GPU machine (no package registry): builds transom
# with the CUDA backend against Debian packages carried in .gpu/debs, runs
# the GPU tests, then bench/gpu_vs_torch.sh in fp32 and bf16. One command,
# every step under its own timeout, so a hung step still leaves the log.
#
#   here:   bash ../shared/gpu/pack-deps.sh          # fills .gpu/debs
#           mkdir -p .gpu/data && cp ../shared/data/tinyshakespeare.txt .gpu/data/
#   there:  bash bench/gpu_check.sh [tests|bench|all]   (default all)
#
#   env PROFILE="bf16 fp32"  also a per-op profile (TRANSOM_PROFILE) of each
#   env TORCH_MODES="eager"  torch runs for the bench (add compile: a minute more)
#   env STEPS=20             steps per bench run
#
# What the shared run-on-device.sh lacked, found on an H200 (Ubuntu image,
# gcc 13, CUDA 13.0): Debian's luaconf.h includes lua5.4-deb-multiarch.h from
# usr/include/x86_64-linux-gnu (CPATH here); NCCL is PyTorch's wheel
# (nvidia/nccl), not the toolkit's; that gcc warns where CI's does not
# (TRANSOM_WERROR=OFF lists them); ../shared/data does not travel.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
what=${1:-all}
T0=$(date +%s)
el() { echo "[+$(($(date +%s) - T0))s] $*"; }

P=/opt/transom-deps ML=x86_64-linux-gnu
mkdir -p "$P"
for f in .gpu/debs/*.deb; do dpkg -x "$f" "$P"; done
export PKG_CONFIG_SYSROOT_DIR=$P
export PKG_CONFIG_LIBDIR=$P/usr/lib/$ML/pkgconfig:$P/usr/lib/$ML/openblas-pthread/pkgconfig:$P/usr/share/pkgconfig
export LD_LIBRARY_PATH=$P/usr/lib/$ML:$P/usr/lib/$ML/openblas-pthread:${LD_LIBRARY_PATH:-}
export LIBRARY_PATH=$P/usr/lib/$ML:$P/usr/lib/$ML/openblas-pthread:${LIBRARY_PATH:-}
export CPATH=$P/usr/include/$ML${CPATH:+:$CPATH}
export LUA_PATH="$P/usr/share/lua/5.4/?.lua;$P/usr/share/lua/5.4/?/init.lua;;"
export LUA_CPATH="$P/usr/lib/$ML/lua/5.4/?.so;;"
export PATH=$P/usr/bin:/usr/local/cuda/bin:$PATH
CORPUS=../shared/data/tinyshakespeare.txt
if [ ! -f "$CORPUS" ] && [ -f .gpu/data/tinyshakespeare.txt ]; then
  mkdir -p ../shared/data && cp .gpu/data/tinyshakespeare.txt ../shared/data/
fi
nvidia-smi -L || { echo "gpu_check: no GPU visible" >&2; exit 2; }
nvcc --version | tail -1

NI=$(ls /usr/local/cuda/include/nccl.h /usr/include/nccl.h \
  /opt/torch/.venv/lib/python3*/site-packages/nvidia/nccl/include/nccl.h 2>/dev/null | head -1)
NL=$(ls /usr/local/cuda/lib64/libnccl.so* /usr/local/cuda/lib/libnccl.so* /usr/lib/$ML/libnccl.so* \
  /opt/torch/.venv/lib/python3*/site-packages/nvidia/nccl/lib/libnccl.so* 2>/dev/null | head -1)
NCCL=()
if [ -n "$NI" ] && [ -n "$NL" ]; then
  NCCL=(-DTRANSOM_NCCL=ON -DTRANSOM_NCCL_INC="$(dirname "$NI")" -DTRANSOM_NCCL_LIB="$NL")
  export LD_LIBRARY_PATH=$(dirname "$NL"):$LD_LIBRARY_PATH
fi
el "nccl: ${NI:-none} ${NL:-}"
cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DTRANSOM_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DTRANSOM_WERROR=OFF "${NCCL[@]}" >build-gpu.cfg.log 2>&1 || { cat build-gpu.cfg.log; exit 1; }
grep "transom:" build-gpu.cfg.log
cmake --build build-gpu -j"$(nproc)" 2>&1 | grep -E "error|warning:" | head -40
[ -x build-gpu/transom ] || { el "build failed"; exit 1; }
el built
build-gpu/transom version

if [ "$what" != bench ]; then
  for t in test_cuda test_nccl; do
    el "$t"
    (cd build-gpu && timeout 150 "./$t" 2>&1 | grep -v "^  ok " | tail -40; echo "$t rc=${PIPESTATUS[0]}")
  done
  el device_spec
  timeout 200 build-gpu/transom test spec/device_spec.lua 2>&1 | tail -30
fi
if [ "$what" != tests ]; then
  for pr in fp32 bf16; do
    el "bench $pr"
    PRECISION=$pr STEPS=${STEPS:-20} WARMUP=5 TORCH_MODES=${TORCH_MODES:-eager} TRANSOM=build-gpu/transom \
      OUT=/tmp/gpu-bench-$pr timeout 200 bench/gpu_vs_torch.sh 2>&1 | grep -v '^step \|"step"' | tail -30
  done
fi
for pr in ${PROFILE:-}; do
  el "op profile $pr"
  rm -rf /tmp/gpu-prof-"$pr" # a run_dir that holds an earlier run is refused
  TRANSOM_PROFILE=1 timeout 100 build-gpu/transom run examples/shakespeare.lua --set data="$CORPUS" \
    --set device=cuda --set precision="$pr" --set n_layer=12 --set n_head=12 --set n_embd=768 \
    --set block_size=1024 --set batch_size=8 --set max_steps=12 --set eval_interval=0 --set sample_tokens=0 \
    --set log_interval=4 --set checkpoint.every_steps=0 --set checkpoint.every_seconds=0 \
    --set run_dir=/tmp/gpu-prof-"$pr" 2>&1 | grep -A16 "op profile"
done
el done
