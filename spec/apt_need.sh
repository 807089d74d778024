#!/usr/bin/env bash
# apt_need.sh — installs the Debian packages of the commands that are
# missing, and nothing when every command is there (so a machine that has
# them never touches apt). Used by detector/test_deps.sh, spec/hosts/deps.sh,
# spec/fuzz/deps.sh and the benches that need OpenMPI.
#
#   spec/apt_need.sh LABEL COMMAND:PACKAGE ...
#   spec/apt_need.sh test_deps gnuplot:gnuplot-nox promtool:prometheus
#   spec/apt_need.sh "fuzz deps" clang:clang -:libomp-dev   (-: no command, the package itself)
#
# Packages go in without their recommends; sudo when not root. Exit status:
# apt-get install's (set -e), 2 on a malformed argument.
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: apt_need.sh LABEL COMMAND:PACKAGE ..." >&2; exit 2; }
label=$1
shift
missing=()
for pair in "$@"; do
  [[ $pair == ?*:?* ]] || { echo "apt_need.sh: '$pair' is not COMMAND:PACKAGE" >&2; exit 2; }
  if [ "${pair%%:*}" = - ]; then
    dpkg-query -W -f='${Status}' "${pair#*:}" 2>/dev/null | grep -q "ok installed" && continue
  else
    command -v "${pair%%:*}" >/dev/null 2>&1 && continue
  fi
  [[ " ${missing[*]-} " == *" ${pair#*:} "* ]] || missing+=("${pair#*:}")
done
[ ${#missing[@]} -eq 0 ] && exit 0
echo "$label: installing ${missing[*]}"
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
$SUDO apt-get update -qq || true
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
