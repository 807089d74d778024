#!/usr/bin/env bash
# test_deps.sh — installs what the detector's tests use from Debian, only
# when missing: gnuplot-nox (`transom plot`) and prometheus (for `promtool
# check metrics`; Debian has no smaller package that ships promtool, so the
# full package is installed, without its recommends). test.sh calls this
# before ctest; the tests themselves skip with a message when a tool is
# absent, unless TRANSOM_REQUIRE_PROMTOOL=1 / TRANSOM_REQUIRE_GNUPLOT=1.
exec "$(dirname "$0")/../spec/apt_need.sh" test_deps gnuplot:gnuplot-nox promtool:prometheus
