#!/usr/bin/env bash
# Installs what building and testing automagic needs on a fresh Debian
# machine (idempotent). Sourced by test.sh and demo.sh.
set -euo pipefail
APT_PKGS="build-essential cmake pkg-config libcmocka-dev libcjson-dev zlib1g-dev valgrind"
missing=""
for p in $APT_PKGS; do
  dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"
done
if [ -n "$missing" ]; then
  echo "== apt-get install$missing"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing >/dev/null
fi
PY=${PYTHON:-python3}
# torch==2.13.0 is a CPU build (a newer or unpinned torch is a multi-GB CUDA download).
if ! out=$($PY -m pip install -q --disable-pip-version-check torch==2.13.0 pytest numpy matplotlib safetensors pytest-timeout 2>&1); then
  echo "$out" >&2
  echo "setup_env.sh: pip install failed" >&2
  exit 1
fi
echo "$out" | grep -v "as the 'root' user" || true
