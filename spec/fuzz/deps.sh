#!/usr/bin/env bash
# deps.sh — installs what the fuzz targets need from Debian, only when
# missing: clang, its libFuzzer and sanitizer runtimes (libclang-rt-dev;
# clang only recommends it) and its OpenMP (libomp-dev: the tensor module
# is built with -fopenmp). test.sh calls this before spec/fuzz/run.sh; if
# clang still cannot build a fuzzer afterwards (no network, no sudo),
# test.sh skips the fuzz runs with a message.
set -euo pipefail
missing=()
command -v clang >/dev/null 2>&1 || missing+=(clang)
for p in libclang-rt-dev libomp-dev; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
echo "fuzz deps: installing ${missing[*]}"
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
$SUDO apt-get update -qq || true
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
