#!/usr/bin/env bash
# The Python tests again on the oldest torch the package supports (its
# pyproject.toml floor, python/automagic/_torch_version.py's MIN_TORCH, read
# from there), so that the floor stays true: torch 2.6.0 in its own virtual environment
# (build/venv-torch-oldest, about 5.4 GB with the CUDA libraries PyPI's torch
# loads at import; kept between runs), against the library scripts/test.sh
# built in build/test and the front end's source.
# Usage: scripts/test_oldest_torch.sh   (from the repository root, after the build)
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/python_env.sh
# the package's floor, MIN_TORCH = (2, 6) in _torch_version.py: torch 2.6.0
TORCH=$($PY -c 'import re, sys
m = re.search(r"^MIN_TORCH = \((\d+), (\d+)\)", open(sys.argv[1]).read(), re.M)
print("%s.%s.0" % m.groups())' python/automagic/_torch_version.py)
VENV=build/venv-torch-oldest
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH')" 2>/dev/null; then
  rm -rf "$VENV"
  $PY -m venv "$VENV"
  if ! out=$("$VENV/bin/python" -m pip install -q --disable-pip-version-check \
        "torch==$TORCH" "numpy<2.3" pytest pytest-timeout safetensors matplotlib 2>&1); then
    echo "$out" >&2
    echo "test_oldest_torch.sh: pip install of torch $TORCH failed" >&2
    exit 1
  fi
fi
export AUTOMAGIC_LIBRARY=$PWD/build/test/libautomagic.so PYTHONPATH=$PWD/python
[ -f build/test/libautomagic_cuda.so ] && export AUTOMAGIC_CUDA_LIBRARY=$PWD/build/test/libautomagic_cuda.so
"$VENV/bin/python" -m pytest -q --timeout=900 -p no:cacheprovider tests/python
