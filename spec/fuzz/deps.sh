#!/usr/bin/env bash
# deps.sh — installs what the fuzz targets need from Debian, only when
# missing: clang, its libFuzzer and sanitizer runtimes (libclang-rt-dev;
# clang only recommends it) and its OpenMP (libomp-dev: the tensor module
# is built with -fopenmp). test.sh calls this before spec/fuzz/run.sh; if
# clang still cannot build a fuzzer afterwards (no network, no sudo),
# test.sh skips the fuzz runs with a message.
exec "$(dirname "$0")/../apt_need.sh" "fuzz deps" clang:clang -:libclang-rt-dev -:libomp-dev
