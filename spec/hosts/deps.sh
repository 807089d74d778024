#!/usr/bin/env bash
# deps.sh — installs what spec/slurm_spec.lua uses from Debian, only when
# missing: slurm-wlm (slurmctld, slurmd, sbatch, srun) and munge. test.sh
# calls this before ctest; the spec skips with a message when they are
# absent. The test hosts themselves (testhosts.sh) need only iproute2.
exec "$(dirname "$0")/../apt_need.sh" "hosts deps" slurmctld:slurm-wlm munged:munge
