#!/usr/bin/env bash
# The main job: build libautomagic and amdemo, train a character-level MLP
# language model in C with Automagic3 and AdamW (float32, and bfloat16 with
# stochastic vs round-to-nearest rounding), then plot the curves.
# Usage: scripts/demo.sh [amdemo options]      (scripts/demo.sh --help)
# Writes out/demo/{curves.csv,summary.txt,demo.png} (or the --out directory).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. scripts/python_env.sh
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"

# The demo's own needs: the word list (Debian wamerican) and matplotlib.
if ! dpkg -s wamerican >/dev/null 2>&1; then
  echo "== apt-get install wamerican (the training data)"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq wamerican >/dev/null
fi
if ! $PY -c "import matplotlib" >/dev/null 2>&1; then
  echo "== installing matplotlib (for the plot)"
  $PY -m pip install -q --disable-pip-version-check matplotlib 2>&1 | grep -v "as the 'root' user" || true
  if ! $PY -c "import matplotlib" >/dev/null 2>&1; then
    # a system Python that pip may not touch (PEP 668): the Debian package
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq python3-matplotlib >/dev/null
  fi
fi

cmake -S . -B build/demo -DCMAKE_BUILD_TYPE=Release -DAM_BUILD_TESTS=OFF >/dev/null
cmake --build build/demo -j"$(nproc)" --target amdemo >/dev/null

# Where amdemo writes: the last --out/-o given, else out/demo.
out=out/demo
prev=""
for a in "$@"; do
  case "$a" in
    -h|--help) exec ./build/demo/demo/amdemo --help ;;
    --out=*) out=${a#--out=} ;;
    -o?*) out=${a#-o} ;;
  esac
  if [ "$prev" = "-o" ] || [ "$prev" = "--out" ]; then out=$a; fi
  prev=$a
done
./build/demo/demo/amdemo --out "$out" "$@"
$PY demo/plot.py "$out"
