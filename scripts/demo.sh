#!/usr/bin/env bash
# The main job: build libautomagic and run the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
cmake -S . -B build/demo -DCMAKE_BUILD_TYPE=Release -DAM_BUILD_TESTS=OFF >/dev/null
cmake --build build/demo -j"$(nproc)" >/dev/null
./build/demo/examples/quickstart "$@"
