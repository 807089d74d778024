#!/usr/bin/env bash
# setup.sh — installs what transom needs from Debian, builds it, and makes the
# default corpus. Safe to run again: it installs only missing packages and
# rebuilds incrementally.
#
#   ./setup.sh            install + release build in build/
#   ./setup.sh --no-build install only
set -euo pipefail
cd "$(dirname "$0")"

PACKAGES=(build-essential cmake pkg-config liblua5.4-dev lua5.4 libevent-dev liblmdb-dev
          libopenblas-dev libedit-dev lua-busted fortunes python3 python3-venv tmux)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# The default corpus: every fortune file from Debian's `fortunes` packages.
if [ ! -s data/fortunes.txt ]; then
  mkdir -p data
  find /usr/share/games/fortunes -maxdepth 1 -type f ! -name '*.dat' ! -name '*.u8' -print0 \
    | sort -z | xargs -0 cat > data/fortunes.txt.tmp
  mv data/fortunes.txt.tmp data/fortunes.txt
  echo "setup: wrote data/fortunes.txt ($(wc -c < data/fortunes.txt) bytes)"
fi

[ "${1:-}" = "--no-build" ] && exit 0
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)"
echo "setup: built build/transom"
