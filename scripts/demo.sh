#!/usr/bin/env bash
# The main job: build libautomagic and amdemo, train a character-level MLP
# language model in C with Automagic3 and AdamW (float32, and bfloat16 with
# stochastic vs round-to-nearest rounding), then plot the curves.
# Usage: scripts/demo.sh [amdemo options]      (scripts/demo.sh --help)
# Writes out/demo/{curves.csv,summary.txt,demo.png} (or the --out directory).
set -euo pipefail
caller=$PWD # relative --data and --out name paths from here, where it was run
cd "$(dirname "$0")/.."
root=$PWD
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

# (build/demo-release, not build/demo: that is the demo folder of a build/
# tree, as the README's C quick start makes, and two trees in one folder
# broke its cmake --install; found by a review, thirty-third session)
cmake -S . -B build/demo-release -DCMAKE_BUILD_TYPE=Release -DAM_BUILD_TESTS=OFF >/dev/null
cmake --build build/demo-release -j"$(nproc)" --target amdemo >/dev/null

# out/demo unless the arguments name another --out (the last one wins);
# amdemo says where it wrote (AMDEMO_OUT_DIR_FILE): re-parsing its options
# here missed forms getopt_long takes (--ou abbr, -qo dir) and plotted an
# old directory. Nothing written (--help): nothing to plot.
told=$(mktemp)
trap 'rm -f "$told"' EXIT
# (run from the caller's directory: relative paths in the arguments are
# theirs; the default output stays the repository's out/demo)
(cd "$caller" && AMDEMO_OUT_DIR_FILE="$told" "$root/build/demo-release/demo/amdemo" \
  --out "$root/out/demo" "$@")
if [ -s "$told" ]; then
  (cd "$caller" && $PY "$root/demo/plot.py" "$(cat "$told")")
fi
