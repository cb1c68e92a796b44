#!/usr/bin/env bash
# Installs what building and testing automagic needs on a fresh Debian
# machine (idempotent). Run by test.sh and demo.sh (not sourced).
set -euo pipefail
cd "$(dirname "$0")/.."
# python3-pip, python3-venv: a minimal Debian has neither (pip below; .venv).
APT_PKGS="build-essential cmake pkg-config libcmocka-dev libcjson-dev zlib1g-dev valgrind"
# libopenmpi-dev, openmpi-bin: examples/zero_mpi.c and its test (sharded data parallelism)
APT_PKGS="$APT_PKGS libopenmpi-dev openmpi-bin"
# locales: the locale sources tests/c/run_locale_test.sh builds with localedef
APT_PKGS="$APT_PKGS locales"
APT_PKGS="$APT_PKGS python3 python3-pip python3-venv"
missing=""
arch=$(dpkg --print-architecture)
for p in $APT_PKGS; do
  # NAME:ARCH when another architecture's build is installed too
  # (scripts/test_aarch64.sh adds the arm64 ones): plain NAME is ambiguous then
  dpkg -s "$p" >/dev/null 2>&1 || dpkg -s "$p:$arch" >/dev/null 2>&1 || missing="$missing $p"
done
if [ -n "$missing" ]; then
  echo "== apt-get install$missing"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing >/dev/null
fi
. scripts/python_env.sh
if [ "$PY" = "$PWD/.venv/bin/python" ] && [ ! -x "$PY" ]; then
  echo "== python3 is externally managed (PEP 668): creating .venv"
  python3 -m venv --system-site-packages .venv
fi
# torch==2.13.0 is a CPU build (a newer or unpinned torch is a multi-GB CUDA download).
if ! out=$($PY -m pip install -q --disable-pip-version-check torch==2.13.0 pytest numpy matplotlib safetensors pytest-timeout 2>&1); then
  echo "$out" >&2
  echo "setup_env.sh: pip install failed" >&2
  exit 1
fi
echo "$out" | grep -v "as the 'root' user" || true
