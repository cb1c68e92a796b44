#!/usr/bin/env bash
# The Python tests again on the oldest torch the package supports (its
# pyproject.toml floor, python/automagic/_torch_version.py), so that the
# floor stays true: torch 2.6.0 in its own virtual environment
# (build/venv-torch-oldest, about 5.4 GB with the CUDA libraries PyPI's torch
# loads at import; kept between runs), against the library scripts/test.sh
# built in build/test and the front end's source.
# Usage: scripts/test_oldest_torch.sh   (from the repository root, after the build)
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/python_env.sh
TORCH=2.6.0
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
# the torch installed here is the floor the package states (a check that
# fails when one of the two is changed without the other)
"$VENV/bin/python" - "$TORCH" <<'PYEOF'
import sys
from automagic import _torch_version
want = tuple(int(x) for x in sys.argv[1].split(".")[:2])
if want != _torch_version.MIN_TORCH:
    sys.exit("test_oldest_torch.sh tests torch %s but the package's floor is %d.%d"
             % ((sys.argv[1],) + _torch_version.MIN_TORCH))
PYEOF
"$VENV/bin/python" -m pytest -q --timeout=900 -p no:cacheprovider tests/python
