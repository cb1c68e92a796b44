#!/usr/bin/env bash
# The benchmark's smoke run: bench/bench.py --quick (small shapes, one
# repetition, no GPT-2 step, which builds about 8 GB of optimizers) into a
# temporary folder, then a check that it measured every case and wrote its
# table, JSON and plot. Times are not checked (the machines are noisy):
# this only keeps the documented benchmark command working.
# Usage: scripts/test_bench.sh   (from the repository root, after setup_env.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/python_env.sh
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
if ! log=$($PY bench/bench.py --quick --no-gpt2 --out "$out" 2>&1); then
  echo "$log" >&2
  echo "test_bench.sh: bench/bench.py --quick failed" >&2
  exit 1
fi
$PY - "$out" <<'PYEOF'
import json, os, sys
out = sys.argv[1]
r = json.load(open(os.path.join(out, "bench.json")))
bad = []
threads = sorted({k["threads"] for k in r["kernels"]})
dtypes = {"float32", "bfloat16", "float16"}
for t in threads:
    seen = {k["dtype"] for k in r["kernels"] if k["threads"] == t and k["sec_min"] > 0}
    if seen != dtypes:
        bad.append("kernel cases at %d thread(s) cover %s, not %s" % (t, sorted(seen), sorted(dtypes)))
if threads != [1, 2]:
    bad.append("kernel cases ran at %s threads, not [1, 2]" % threads)
for case in r["torch"]:
    for kind in ("ours", "adamw_fused"):
        if not case.get(kind, {}).get("sec_min", 0) > 0:
            bad.append("torch case %s %s: no time for %s (%s)"
                       % (case["shape"], case["dtype"], kind, case.get(kind)))
if not r["torch"]:
    bad.append("no torch cases")
if not r["lora"] or not r["lora_train"]:
    bad.append("no LoRA results")
if not r["machine"].get("commit"):  # (run from a git checkout here)
    bad.append("the result does not name the commit it measured")
for name in ("bench.md", "bench.png"):
    path = os.path.join(out, name)
    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        bad.append("%s missing or empty" % name)
md = open(os.path.join(out, "bench.md")).read()
if "| shape | dtype | thr |" not in md:
    bad.append("bench.md has no table")
if bad:
    print("test_bench.sh: " + "; ".join(bad), file=sys.stderr)
    sys.exit(1)
print("benchmark smoke run: %d kernel cases, %d torch cases, LoRA; table, JSON and plot written"
      % (len(r["kernels"]), len(r["torch"])))
PYEOF
