#!/usr/bin/env bash
# test_deps.sh — installs what the detector's tests use from Debian, only
# when missing: gnuplot-nox (`transom plot`) and prometheus (for `promtool
# check metrics`; Debian has no smaller package that ships promtool, so the
# full package is installed, without its recommends). test.sh calls this
# before ctest; the tests themselves skip with a message when a tool is
# absent, unless TRANSOM_REQUIRE_PROMTOOL=1 / TRANSOM_REQUIRE_GNUPLOT=1.
set -euo pipefail
missing=()
command -v gnuplot >/dev/null 2>&1 || missing+=(gnuplot-nox)
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
[ ${#missing[@]} -eq 0 ] && exit 0
echo "test_deps: installing ${missing[*]}"
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
$SUDO apt-get update -qq || true
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
