"""The front end's loader: the C library's version and where it is found."""
import os
import re
import subprocess
import sys

import pytest

import automagic
from automagic import _lib

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def test_versions_agree():
    # the front end, the header, CMake and the Python package say the same
    with open(os.path.join(ROOT, "include", "automagic.h")) as f:
        h = f.read()
    header = ".".join(re.search(r"#define AM_VERSION_%s (\d+)" % k, h).group(1)
                      for k in ("MAJOR", "MINOR", "PATCH"))
    with open(os.path.join(ROOT, "CMakeLists.txt")) as f:
        cmake = re.search(r"project\(automagic VERSION ([0-9.]+)", f.read()).group(1)
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        py = re.search(r'^version = "([0-9.]+)"', f.read(), re.M).group(1)
    assert header == cmake == py == _lib.LIBRARY_VERSION == automagic.__version__


def test_library_of_another_version_is_refused(monkeypatch):
    # an older library (same symbols) loaded silently and behaved
    # differently; now the import says which versions met
    monkeypatch.setattr(_lib, "LIBRARY_VERSION", "9.9.9")
    with pytest.raises(ImportError, match=r"is libautomagic %s; this front end needs 9\.9\.9"
                       % re.escape(automagic.__version__)):
        _lib._load()


def test_found_in_every_package_folder(monkeypatch, tmp_path):
    # 'pip install -e' serves the .py files from the source tree and puts
    # the library in site-packages/automagic: found through __path__
    # (the source folder simulated: one without the library, so that the
    # test runs against an installed package too)
    monkeypatch.delenv("AUTOMAGIC_LIBRARY", raising=False)
    src, site = tmp_path / "src", tmp_path / "site"
    src.mkdir()
    site.mkdir()
    os.symlink(os.path.abspath(_lib._path), str(site / "libautomagic.so"))
    monkeypatch.setattr(_lib, "__file__", str(src / "_lib.py"))
    monkeypatch.setattr(automagic, "__path__", [str(src), str(site)])
    path, where = _lib._find_library()
    assert path == str(site / "libautomagic.so") and where == "the package"


@pytest.mark.parametrize("target, match", [
    # (a file that is not there is named as such: the message suggested a
    # missing dependency)
    ("/nonexistent/libautomagic.so", r"from AUTOMAGIC_LIBRARY\) does not exist"),
    (None, "is not libautomagic"),
])
def test_load_errors_say_what_and_where(target, match):
    if target is None:  # a real shared library that is not ours
        import ctypes.util
        name = ctypes.util.find_library("z")
        if name is None:
            pytest.skip("no libz to load")
        target = name
    env = dict(os.environ, AUTOMAGIC_LIBRARY=target)
    r = subprocess.run([sys.executable, "-c", "import automagic"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert re.search(match, r.stderr.replace("\n", " ")), r.stderr
    assert "ImportError" in r.stderr


def test_cuda_library_beside_automagic_library(tmp_path, monkeypatch):
    # AUTOMAGIC_LIBRARY alone (a build tree's) paired its CPU library with
    # the installed CUDA one; the libautomagic_cuda.so beside it is taken
    from automagic import _cuda
    cpu = tmp_path / "libautomagic.so"
    cpu.write_bytes(b"")
    monkeypatch.delenv("AUTOMAGIC_CUDA_LIBRARY", raising=False)
    monkeypatch.setenv("AUTOMAGIC_LIBRARY", str(cpu))
    assert _cuda._library_path() != str(tmp_path / "libautomagic_cuda.so")  # none there
    (tmp_path / "libautomagic_cuda.so").write_bytes(b"")
    assert _cuda._library_path() == str(tmp_path / "libautomagic_cuda.so")
    monkeypatch.setenv("AUTOMAGIC_CUDA_LIBRARY", "/elsewhere/libautomagic_cuda.so")
    assert _cuda._library_path() == "/elsewhere/libautomagic_cuda.so"  # still wins


@pytest.mark.parametrize("version", ["2.6.0", "2.13.0+cpu", "2.10.1", "2.7.0a0+git1234",
                                     "2.14.1+cu128", "local-build"])
def test_supported_torch_versions_pass_the_import_check(version):
    from automagic import _torch_version
    _torch_version.check(version)


@pytest.mark.parametrize("version", ["2.5.1", "2.4.1+cu121", "1.13.1", "2.1.0a0"])
def test_older_torch_is_refused_at_import_naming_both_versions(version):
    # torch 2.4.1 ran the front end into errors mid-step (README, "Dependencies")
    from automagic import _torch_version
    with pytest.raises(ImportError, match=r"needs torch 2\.6 or newer; this is torch "
                       + re.escape(version)):
        _torch_version.check(version)


def test_package_requires_the_torch_the_import_checks():
    from automagic import _torch_version
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        floor = re.search(r'"torch>=(\d+)\.(\d+)"', f.read()).groups()
    assert tuple(int(x) for x in floor) == _torch_version.MIN_TORCH
