#!/usr/bin/env bash
# The GPU check: on a machine with an NVIDIA GPU, build everything, run the
# CUDA tests (against the CPU path, and against the reference class on CUDA
# tensors) and the GPU benchmarks (against the device's measured copy
# bandwidth, and against the reference on the GPU). Every stage has a time
# limit; the whole script stays under about 8 minutes on an H200.
#
# Usage: scripts/gpu_check.sh OUT_DIR      (from anywhere; needs no network)
#        GPU_CHECK_PACK=1 scripts/gpu_check.sh OUT_DIR   (logs in logs.tar.gz)
# Writes to OUT_DIR: summary.txt (one line per stage: ok / FAILED / skipped,
# seconds), nvidia-smi.txt, build.log, ctest_cuda.log, ctest.log, bench_c.jsonl, bench_c.txt,
# bench_c.png, pytest.log, bench_python.{json,png,log}.
# Exit status: 0 when every stage that ran passed, 1 otherwise.
set -uo pipefail
OUT=${1:?usage: scripts/gpu_check.sh OUT_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
BUILD=build/gpu_check
JOBS=$(nproc)
status=0
: > "$OUT/summary.txt"

# stage NAME LIMIT_S LOG 'COMMAND' : runs COMMAND (a bash command line) with a
# time limit, logs it, records the outcome.
stage() {
  local name=$1 limit=$2 log=$3; shift 3
  local t0=$SECONDS rc
  echo "== $name (limit ${limit}s)"
  timeout --kill-after=10 "$limit" bash -c "$1" > "$OUT/$log" 2>&1
  rc=$?
  local dt=$((SECONDS - t0))
  if [ $rc -eq 0 ]; then
    echo "$name: ok (${dt}s)" | tee -a "$OUT/summary.txt"
  elif [ $rc -eq 77 ]; then
    echo "$name: skipped (${dt}s): $(tail -1 "$OUT/$log")" | tee -a "$OUT/summary.txt"
  else
    [ $rc -eq 124 ] && echo "(time limit reached)" >> "$OUT/$log"
    echo "$name: FAILED rc=$rc (${dt}s), see $log" | tee -a "$OUT/summary.txt"
    tail -20 "$OUT/$log"
    status=1
  fi
  return $rc
}

# The build needs cJSON and zlib's headers, the C tests cmocka, CMake
# pkg-config; a GPU machine without network gets those it lacks from .deps/
# (scripts/gpu_prepare.sh), unpacked under /tmp.
CMAKE_EXTRA=()
if ! { pkg-config --exists cmocka && pkg-config --exists libcjson && [ -f /usr/include/zlib.h ]; } 2>/dev/null \
   && ls .deps/*.deb >/dev/null 2>&1; then
  D=/tmp/am_deps
  for f in .deps/*.deb; do dpkg-deb -x "$f" "$D" 2>/dev/null || dpkg -x "$f" "$D"; done
  L=$D/usr/lib/x86_64-linux-gnu
  mkdir -p "$D/pc"
  printf 'Name: cmocka\nDescription: cmocka\nVersion: 1.1.5\nLibs: -L%s -lcmocka\nCflags: -I%s\n' \
    "$L" "$D/usr/include" > "$D/pc/cmocka.pc"
  printf 'Name: libcjson\nDescription: cJSON\nVersion: 1.7.15\nLibs: -L%s -lcjson\nCflags: -I%s -I%s/cjson\n' \
    "$L" "$D/usr/include" "$D/usr/include" > "$D/pc/libcjson.pc"
  ln -sf "$D/lib/x86_64-linux-gnu/libz.so.1" "$L/libz.so" # the deb's link is absolute
  export PATH="$D/usr/bin:$PATH" PKG_CONFIG_PATH="$D/pc${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
  export LD_LIBRARY_PATH="$L:$D/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  [ -f /usr/include/zlib.h ] || CMAKE_EXTRA=(-DZLIB_INCLUDE_DIR="$D/usr/include" -DZLIB_LIBRARY="$L/libz.so")
  echo "deps: cmocka/cJSON/zlib/pkg-config unpacked from .deps into $D" | tee -a "$OUT/summary.txt"
fi
# The reference class beside the repository, as the tests expect it.
if [ ! -f ../shared/reference/automagic3.py ] && [ -f .deps/reference/automagic3.py ]; then
  mkdir -p ../shared/reference && cp .deps/reference/automagic3.py ../shared/reference/ &&
    echo "deps: reference class copied from .deps to ../shared/reference" | tee -a "$OUT/summary.txt"
fi
{ date -u; nvidia-smi; nvcc --version; } > "$OUT/nvidia-smi.txt" 2>&1 || true
echo "GPU: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null)" \
  | tee -a "$OUT/summary.txt"

export OUT BUILD JOBS PY
export CMAKE_EXTRA_ARGS="${CMAKE_EXTRA[*]}"
if ! stage build 150 build.log \
  'cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DAM_CUDA=ON $CMAKE_EXTRA_ARGS &&
   cmake --build "$BUILD" -j"$JOBS"'; then
  echo "build failed: nothing else can run" | tee -a "$OUT/summary.txt"
  exit 1
fi

# C: the GPU test first, in a stage of its own (test_cuda with the 1 x 100M
# and 50000 x 4096 cases), so that the scarce GPU time gives its result even
# if the CPU tests run long; then every other test (the CUDA plan's and
# kernels' emulations among them). Built without -Werror here: a newer
# compiler's new warning must not cost the one GPU run (CI keeps -Werror).
stage ctest_cuda 120 ctest_cuda.log \
  'AM_CUDA_TEST_LARGE=1 ctest --test-dir "$BUILD" --output-on-failure --timeout 110 -R "^test_cuda$"'
stage ctest 130 ctest.log \
  'ctest --test-dir "$BUILD" --output-on-failure --timeout 125 -j"$JOBS" -E "^test_cuda$"'
grep -q "test_cuda .*Skipped" "$OUT/ctest_cuda.log" && {
  echo "ctest: test_cuda was SKIPPED (no device seen by the CUDA runtime)" | tee -a "$OUT/summary.txt"
  status=1
}

# C benchmark: bandwidth ratios, no Python needed.
stage bench_c 90 bench_c.log \
  '"$BUILD/bench_cuda" > "$OUT/bench_c.jsonl" 2> "$OUT/bench_c.txt"; rc=$?; cat "$OUT/bench_c.txt"; exit $rc' &&
  cat "$OUT/bench_c.txt"

# Python: the package from the source tree with the libraries just built (no
# pip: the machine may have no network). Needs a CUDA build of torch.
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
export AUTOMAGIC_LIBRARY="$PWD/$BUILD/libautomagic.so"
export AUTOMAGIC_CUDA_LIBRARY="$PWD/$BUILD/libautomagic_cuda.so"
if $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  stage pytest 120 pytest.log '$PY -m pytest -q -rs tests/python'
  grep -q "skipped" "$OUT/pytest.log" && grep -i "skip" "$OUT/pytest.log" | head -5
  stage bench_python 120 bench_python.log '$PY scripts/bench_cuda.py "$OUT"' && \
    cat "$OUT/bench_python.log"
else
  echo "pytest, bench_python: skipped: $($PY -c 'import torch; print("torch", torch.__version__, "has no CUDA")' 2>&1 | tail -1)" \
    | tee -a "$OUT/summary.txt"
fi

# Figure of the C benchmark (optional: needs matplotlib).
$PY - "$OUT" <<'EOF' >> "$OUT/summary.txt" 2>&1 || true
import json, os, sys
out = sys.argv[1]
path = os.path.join(out, "bench_c.jsonl")
rows = [json.loads(l) for l in open(path) if '"case"' in l] if os.path.exists(path) else []
if not rows:
    sys.exit(0)
for r in rows:
    if r["numel"] >= 1 << 24:
        print("bandwidth %-22s %-8s %5.1f%% of copy (target 70%%)"
              % (r["case"], r["dtype"], 100 * r["fraction_of_copy_bw"]))
try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    print("no matplotlib: bench_c.png not drawn")
    sys.exit(0)
fig, ax = plt.subplots(figsize=(10, 4))
ax.bar(range(len(rows)), [100 * r["fraction_of_copy_bw"] for r in rows])
ax.axhline(70, color="red", linestyle="--", label="target 70% (>= 16M elements)")
ax.set_xticks(range(len(rows)))
ax.set_xticklabels(["%s\n%s" % (r["case"], r["dtype"]) for r in rows], fontsize=6)
ax.set_ylabel("3-pass bytes / time, % of copy bandwidth")
ax.legend()
fig.tight_layout()
fig.savefig(os.path.join(out, "bench_c.png"), dpi=120)
EOF

# GPU_CHECK_PACK=1: at most 6 files in OUT_DIR (for tools that fetch only a
# few files back): the logs go into logs.tar.gz.
if [ "${GPU_CHECK_PACK:-0}" = 1 ]; then
  (cd "$OUT" && ls *.log bench_c.txt nvidia-smi.txt 2>/dev/null | xargs tar czf logs.tar.gz &&
   ls *.log bench_c.txt nvidia-smi.txt 2>/dev/null | xargs rm -f)
fi

echo "== summary ($OUT/summary.txt)"
cat "$OUT/summary.txt"
exit $status
