"""ctypes bindings to libautomagic (the C library shipped inside this package).

Only the kernel layer is bound: the PyTorch front end keeps every state buffer
in torch tensors and hands their data pointers to C.
"""
import ctypes
import os
import sys
import threading

AM_MAX_DIMS = 8

DTYPE_FLOAT32, DTYPE_BFLOAT16, DTYPE_FLOAT16 = 0, 1, 2

OK, SKIPPED_NONFINITE_GRAD, SKIPPED_NONFINITE_UPDATE = 0, 1, 2


class Shape(ctypes.Structure):
    _fields_ = [("ndim", ctypes.c_int32), ("dims", ctypes.c_int64 * AM_MAX_DIMS)]


class Tensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("dtype", ctypes.c_int), ("shape", Shape)]


class State(ctypes.Structure):
    _fields_ = [
        ("lr", ctypes.c_void_p),
        ("polarity", ctypes.c_void_p),
        ("row", ctypes.c_void_p),
        ("col", ctypes.c_void_p),
        ("sq", ctypes.c_void_p),
        ("step", ctypes.c_int64),
    ]


class StateSizes(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_int64)
        for name in ("numel", "lr_count", "polarity_bytes", "row_count",
                     "col_count", "sq_count", "workspace_bytes")
    ]


HPARAM_NAMES = ("lr", "min_lr", "max_lr", "lr_bump_rate", "beta2", "eps",
                "clip_threshold", "weight_decay")


class HParams(ctypes.Structure):
    _fields_ = [(name, ctypes.c_double) for name in HPARAM_NAMES]


class RngKey(ctypes.Structure):
    _fields_ = [("seed", ctypes.c_uint64), ("param_id", ctypes.c_uint32)]


class Report(ctypes.Structure):
    _fields_ = [
        ("status", ctypes.c_int),
        ("clip_scale", ctypes.c_float),
        ("mean_agreement", ctypes.c_float),
        ("nonfinite_count", ctypes.c_int64),
    ]


class BatchItem(ctypes.Structure):
    """am_batch_item: one parameter's am_update arguments in am_update_batch."""
    _fields_ = [
        ("param", ctypes.c_void_p),
        ("grad", ctypes.c_void_p),
        ("state", ctypes.c_void_p),
        ("hp", ctypes.c_void_p),
        ("key", RngKey),
        ("report", ctypes.c_void_p),
        ("status", ctypes.c_int),
    ]


LOG_FN = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)


# The C library's version this front end was written against (the header's
# AM_VERSION_*, CMakeLists.txt, pyproject.toml; a test checks they agree).
LIBRARY_VERSION = "0.3.0"


def package_dirs():
    """The folders of the automagic package: this file's, and every one of
    the package's __path__ (an editable install, 'pip install -e', serves
    the .py files from the source tree and puts the built libraries in
    site-packages/automagic/)."""
    here = os.path.dirname(os.path.abspath(__file__))
    pkg = sys.modules.get(__name__.rpartition(".")[0])
    dirs = [here]
    for d in getattr(pkg, "__path__", None) or []:
        d = os.path.abspath(d)
        if d not in dirs:
            dirs.append(d)
    return dirs


def _find_library():
    env = os.environ.get("AUTOMAGIC_LIBRARY")
    if env:
        return env, "AUTOMAGIC_LIBRARY"
    for d in package_dirs():
        path = os.path.join(d, "libautomagic.so")
        if os.path.exists(path):
            return path, "the package"
    raise ImportError(
        "automagic: libautomagic.so is not in %s; install the package with "
        "'pip install .' from the repository root, or point AUTOMAGIC_LIBRARY "
        "at a built libautomagic.so" % " or ".join(package_dirs()))


def _load():
    path, where = _find_library()
    if os.sep in path and not os.path.exists(path):
        # (dlopen's "No such file" sent the reader to look for a missing
        # dependency: found by a review, twenty-third session)
        raise ImportError("automagic: the C library %s (from %s) does not exist"
                          % (path, where))
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        raise ImportError(
            "automagic: the C library %s (from %s) could not be loaded: %s (a library it "
            "needs missing? it links libcjson and zlib: Debian packages libcjson1, "
            "zlib1g)" % (path, where, e)) from None
    try:
        lib.am_version_string.restype = ctypes.c_char_p
        found = lib.am_version_string().decode()
    except AttributeError:
        raise ImportError("automagic: %s (from %s) is not libautomagic (no "
                          "am_version_string)" % (path, where)) from None
    if found != LIBRARY_VERSION:
        raise ImportError(
            "automagic: %s (from %s) is libautomagic %s; this front end needs %s. Rebuild "
            "it ('pip install .'), or point AUTOMAGIC_LIBRARY at a library of this "
            "version" % (path, where, found, LIBRARY_VERSION))
    return lib, path, where


lib, _path, _where = _load()

_P = ctypes.POINTER
lib.am_status_string.restype = ctypes.c_char_p
lib.am_status_string.argtypes = [ctypes.c_int]
lib.am_version_string.restype = ctypes.c_char_p
lib.am_kernel_name.restype = ctypes.c_char_p
lib.am_hparams_validate.argtypes = [_P(HParams)]
lib.am_state_get_sizes.argtypes = [_P(Shape), _P(StateSizes)]
lib.am_state_init.argtypes = [_P(Shape), _P(State), ctypes.c_double]
lib.am_update.argtypes = [_P(Tensor), _P(Tensor), _P(State), _P(HParams), RngKey,
                          ctypes.c_void_p, ctypes.c_size_t, _P(Report)]
lib.am_update_batch_workspace.argtypes = [_P(BatchItem), ctypes.c_int64, ctypes.c_int,
                                          _P(ctypes.c_size_t)]
lib.am_update_batch.argtypes = [_P(BatchItem), ctypes.c_int64, ctypes.c_void_p,
                                ctypes.c_size_t]
lib.am_set_num_threads.argtypes = [ctypes.c_int]
lib.am_set_log_callback.argtypes = [LOG_FN, ctypes.c_void_p]

# Error messages from C arrive through the log callback; keep the last one of
# each thread so that exceptions can quote it.
_tls = threading.local()


_DEBUG = os.environ.get("AUTOMAGIC_DEBUG") == "1"


def _on_log(level, msg, user):
    text = msg.decode("utf-8", "replace")
    _tls.last = text
    # AUTOMAGIC_DEBUG=1: the library's informational messages (which kernel
    # set runs, and why) go to stderr, as a C program's callback would print.
    if _DEBUG and level <= 1:
        import sys
        sys.stderr.write(text + "\n")
    elif level == _LOG_WARNING:
        # A warning (a bad AUTOMAGIC_TUNING or AUTOMAGIC_PAR_MIN_BYTES,
        # ignored) becomes a Python warning: it was dropped, and a typo in
        # those variables went unreported (a review, thirty-seventh
        # session). Kept here and warned by flush_warnings, which the import
        # calls after the kernels are chosen (the only warnings the front
        # end's calls log): raised from this callback, an exception (under
        # -W error) cannot pass through C, and ctypes only printed it.
        # Errors come back as statuses; the exception quotes their message
        # (last_message).
        _pending.append(text)


_LOG_WARNING = 2  # AM_LOG_WARNING
_pending = []  # the library's warnings not yet given to Python


def flush_warnings():
    """The library's warnings logged so far, as RuntimeWarning at the
    first frame outside this package and torch."""
    if _pending:
        import warnings
        from ._errors import caller_level
        level = caller_level()
        while _pending:
            warnings.warn(_pending.pop(0), RuntimeWarning, stacklevel=level)


_log_cb = LOG_FN(_on_log)  # kept alive for the life of the module
lib.am_set_log_callback(_log_cb, None)


def last_message():
    return getattr(_tls, "last", "")


def clear_message():
    _tls.last = ""


def status_string(status):
    return lib.am_status_string(status).decode()


def version():
    return lib.am_version_string().decode()


def kernel_name():
    return lib.am_kernel_name().decode()
