#!/usr/bin/env bash
# Run HERE (a machine with network) before a GPU check on a machine that has
# none: downloads the Debian packages the build and the C tests need (cmocka,
# cJSON, zlib headers, pkg-config)
# and a copy of the reference class into .deps/ (git-ignored; carry it to the
# GPU machine). scripts/gpu_check.sh
# unpacks them into /tmp when the GPU machine lacks them. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .deps
cd .deps
for p in libcmocka0 libcmocka-dev pkgconf pkgconf-bin libpkgconf3 \
         libcjson1 libcjson-dev zlib1g zlib1g-dev; do
  ls ${p}_*.deb >/dev/null 2>&1 || apt-get download "$p" 2>&1 | grep -v '^W:' || true
done
# The reference class, for the tests and the benchmark against it: the
# folder beside the repository does not travel with the working tree.
if [ -f ../../shared/reference/automagic3.py ]; then
  mkdir -p reference && cp ../../shared/reference/automagic3.py reference/
fi
ls -la . reference 2>/dev/null
