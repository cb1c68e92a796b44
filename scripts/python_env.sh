# Sourced (from the repository root) by setup_env.sh, test.sh and demo.sh:
# sets PY, the Python that the scripts install into and test with.
# $PYTHON wins. Otherwise python3, unless pip may not install into it
# (PEP 668 "externally managed": a fresh Debian 12's /usr/bin/python3
# refuses `pip install`); then the virtual environment .venv of the
# repository, which setup_env.sh creates (it sees the system site-packages).
if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
elif python3 -c 'import os, sys, sysconfig
sys.exit(0 if sys.prefix == sys.base_prefix and os.path.exists(
    os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")) else 1)' 2>/dev/null; then
  PY=$PWD/.venv/bin/python
else
  PY=python3
fi
