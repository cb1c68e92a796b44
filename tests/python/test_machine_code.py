"""The library this front end loads (the wheel's, or AUTOMAGIC_LIBRARY's),
checked by scripts/check_mask_spills.py for a known gcc AVX-512 fault: an
opmask register spilled to the stack narrowly (kmovw: 16 bits) and read back
wider with stale upper bytes (docs/RELIABILITY.md, section 3). CTest checks
the library of the C build; the wheel is built by scikit-build-core in a
build of its own."""
import os
import platform
import shutil
import subprocess
import sys

import pytest

from automagic import _lib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "check_mask_spills.py")


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                    reason="the check reads x86-64 machine code")
@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump (binutils) not installed")
def test_loaded_library_has_no_narrow_mask_spill_read_wider():
    assert os.path.exists(SCRIPT), SCRIPT
    r = subprocess.run([sys.executable, SCRIPT, "--self-test", _lib._path],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "self-test passed" in r.stdout
    assert " 0 suspicious read(s)" in r.stdout
