#!/usr/bin/env bash
# sim_scale.sh — what transom's replace mode buys at 1K..128K GPUs, by
# simulation (transom sim): the table of ETTR and goodput against the GPU
# count for replace mode and restart-all beside the FT-HSDP paper's two
# points, the plot (examples/sim/scale.png, drawn by gnuplot), where the
# lost time goes and which cost moves ETTR most at ~100K GPUs
# (examples/sim/scale.lua: every number says where it comes from); then the
# simulator against the paper's own pair of points (examples/sim/ft-hsdp.lua:
# the failure rate fitted to the 44% point, the 80% point predicted).
# How the simulator compares with a measured run: bench/sim_validate.sh.
#
#   bench/sim_scale.sh            env TRANSOM=build/transom PLOT=examples/sim/scale.png
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${TRANSOM:-build/transom}
PLOT=${PLOT:-examples/sim/scale.png}
"$BIN" sim examples/sim/scale.lua -o "$PLOT"
echo
echo "=== the FT-HSDP paper's two points"
tmp=$(mktemp)
"$BIN" sim examples/sim/ft-hsdp.lua | tee "$tmp" | grep -E '^(ETTR|result|published|  1)'
awk '/^result mode=replace /{split($4, a, "="); r = a[2]} /^result mode=restart_all /{split($4, a, "="); s = a[2]}
     END { printf "FT-HSDP check: restart_all %.3f (paper 0.44, fitted) | replace %.3f (paper 0.80, predicted: %+.1f points)\n", s, r, 100 * (r - 0.80) }' \
  "$tmp"
rm -f "$tmp"
