#!/usr/bin/env bash
# deps.sh — installs what spec/slurm_spec.lua uses from Debian, only when
# missing: slurm-wlm (slurmctld, slurmd, sbatch, srun) and munge. test.sh
# calls this before ctest; the spec skips with a message when they are
# absent. The test hosts themselves (testhosts.sh) need only iproute2.
set -euo pipefail
missing=()
command -v slurmctld >/dev/null 2>&1 || missing+=(slurm-wlm)
command -v munged >/dev/null 2>&1 || missing+=(munge)
[ ${#missing[@]} -eq 0 ] && exit 0
echo "hosts deps: installing ${missing[*]}"
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
$SUDO apt-get update -qq || true
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
