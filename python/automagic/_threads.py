"""Runs libautomagic's parallel work on PyTorch's own OpenMP threads.

PyTorch's CPU build runs its operations on a GNU OpenMP (libgomp) team whose
threads keep spinning for a while after each operation. The library's own
thread pool then competes with them for the same cores: measured on the
2-core development machine (2 threads), a 4096x4096 bfloat16 update right
after a torch operation took 17.8 ms on the own pool and 12.0 ms on
torch's team (docs/PERFORMANCE_HISTORY.md). So, when torch runs on
OpenMP, the front end hands the library's jobs to that team through
am_gomp_runner (the `#pragma omp parallel` entry point of the runtime torch
loaded). Results are bit-identical either way; AUTOMAGIC_TORCH_THREADS=0
keeps the library's own pool.
"""
import ctypes
import os
import sys

import torch

from . import _lib

_lib.lib.am_set_parallel_runner.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
_OPENMP_NAMES = ("libgomp", "libiomp5", "libomp")

runtime = None  # path of the OpenMP runtime found, or None (own pool)
reason = ""     # why it is (not) used
_address = None  # its GOMP_parallel


def _mapped_openmp_runtimes():
    """Paths of the OpenMP runtimes loaded in this process (Linux)."""
    paths = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                # address perms offset dev inode [path]; the path may hold spaces
                fields = line.rstrip("\n").split(None, 5)
                path = fields[5] if len(fields) == 6 else ""
                base = os.path.basename(path)
                if base.startswith(_OPENMP_NAMES) and ".so" in base and path not in paths:
                    paths.append(path)
    except OSError:
        pass
    return paths


def _choose():
    if os.environ.get("AUTOMAGIC_TORCH_THREADS") == "0":
        return None, "AUTOMAGIC_TORCH_THREADS=0"
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None, "torch's parallel backend is not OpenMP"
    found = _mapped_openmp_runtimes()
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    own = [p for p in found if os.path.abspath(p).startswith(torch_dir + os.sep)]
    if own:
        found = own
    if len(found) != 1:
        return None, ("no OpenMP runtime found among the loaded libraries" if not found
                      else "several OpenMP runtimes are loaded (%s)" % ", ".join(found))
    try:
        address = ctypes.cast(ctypes.CDLL(found[0]).GOMP_parallel, ctypes.c_void_p).value
    except (OSError, AttributeError) as e:
        return None, "%s has no usable GOMP_parallel (%s)" % (found[0], e)
    return (found[0], address), "torch's OpenMP runtime"


_enabled = False


def set_enabled(on):
    """Sends the library's jobs to torch's team (on, when one was found) or
    to its own pool; returns whether torch's team was in use before. For
    comparisons (bench.py)."""
    global _enabled
    before = _enabled
    _enabled = bool(on) and _address is not None
    if _enabled:
        _lib.lib.am_set_parallel_runner(
            ctypes.cast(_lib.lib.am_gomp_runner, ctypes.c_void_p), _address)
    else:
        _lib.lib.am_set_parallel_runner(None, None)
    return before


def use_torch_threads():
    """Installs torch's OpenMP team as the library's runner (once per process)."""
    global runtime, reason, _address
    chosen, reason = _choose()
    if chosen is not None:
        runtime, _address = chosen
        set_enabled(True)
    if os.environ.get("AUTOMAGIC_DEBUG") == "1":
        sys.stderr.write("automagic: parallel work on %s\n"
                         % ("%s (%s)" % (reason, runtime) if runtime
                            else "the library's own threads: " + reason))
