#!/usr/bin/env bash
# The whole test suite: C library (CTest, then under sanitizers and valgrind,
# then cross-built for aarch64 and run under qemu), then the PyTorch front
# end (pytest, on torch 2.13 and on the oldest torch it supports), then a
# smoke run of the benchmark.
# Usage: scripts/test.sh      (from the repository root; installs what it needs)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. scripts/python_env.sh
WERROR=${AM_WERROR:-ON}

echo "== C library: configure, build, test"
cmake -S . -B build/test -DCMAKE_BUILD_TYPE=RelWithDebInfo -DAM_WERROR="$WERROR" >/dev/null
cmake --build build/test -j"$(nproc)"
ctest --test-dir build/test --output-on-failure
if [ -f build/test/libautomagic_cuda.so ]; then
  echo "== CUDA code compiled (libautomagic_cuda.so); its GPU tests need a GPU (docs/CUDA.md)"
elif [ "${AM_REQUIRE_CUDA:-0}" = 1 ]; then
  echo "test.sh: AM_REQUIRE_CUDA=1 but the CUDA library was not built (nvcc not found?)" >&2
  exit 1
else
  echo "== nvcc not found: the CUDA code was NOT compiled"
fi

echo "== C library: ASan+UBSan, valgrind, TSan (AM_SANITIZERS=0 skips)"
if [ "${AM_SANITIZERS:-1}" != 0 ]; then
  bash scripts/test_sanitizers.sh
else
  echo "SKIPPED: sanitizer and valgrind runs (AM_SANITIZERS=0)"
fi

echo "== C library for aarch64: cross-built, tests under qemu-user (AM_AARCH64=0 skips)"
if [ "${AM_AARCH64:-1}" != 0 ]; then
  bash scripts/test_aarch64.sh
else
  echo "SKIPPED: aarch64 build and emulated tests (AM_AARCH64=0)"
fi

echo "== C library: install, then build a program against it (pkg-config, CMake)"
bash tests/install/check_install.sh

echo "== Python package: install, test"
if ! out=$($PY -m pip install -q --disable-pip-version-check . 2>&1); then
  echo "$out" >&2
  echo "test.sh: pip install . failed" >&2
  exit 1
fi
# A hung test fails after 15 minutes instead of stalling CI (pytest-timeout).
$PY -m pytest -q --timeout=900 tests/python

echo "== Python front end on the oldest torch it supports (AM_OLDEST_TORCH=0 skips)"
if [ "${AM_OLDEST_TORCH:-1}" != 0 ]; then
  bash scripts/test_oldest_torch.sh
else
  echo "SKIPPED: the Python tests on the oldest supported torch (AM_OLDEST_TORCH=0)"
fi

echo "== Benchmark: smoke run (bench/bench.py --quick; times not checked)"
bash scripts/test_bench.sh
