"""CUDA dispatch for automagic.Automagic3 (see docs/CUDA.md).

A parameter on a CUDA device is updated by libautomagic_cuda.so (shipped in
this package when it was built with nvcc available) on
``torch.cuda.current_stream()``. The call queues the kernels and returns: no
synchronisation and no device-to-host copy, so a training step that contains
it can be captured in a CUDA graph. The workspace is allocated at the first
step of each (device, stream, thread) and grows only for a larger parameter;
each update still makes small tensors through torch's caching allocator (the
skip count's ``ne(0)``, and copies for a non-contiguous parameter or
gradient and for ``lr_schedule="scale"``), which a capture takes from the
graph's pool.

State is the CPU front end's (same keys, same layout), except that
``state["step"]`` is a 0-D int64 tensor on the parameter's device: the kernels
read it and increment it only when the update is applied, which the host
cannot know without synchronising. Updates skipped for a non-finite gradient
are counted on the device; ``nonfinite_skips(opt)`` reads that count (it
synchronises).
"""
import ctypes
import os
import threading

import torch

from . import _lib

_P = ctypes.POINTER
_REPORT_BYTES = ctypes.sizeof(_lib.Report)
_load_lock = threading.Lock()
_cuda_lib = None
_load_error = None


def _library_path():
    env = os.environ.get("AUTOMAGIC_CUDA_LIBRARY")
    if env:
        return env
    cpu = os.environ.get("AUTOMAGIC_LIBRARY")
    if cpu:
        # the CUDA library of the same build (a build tree's CPU library was
        # paired with the installed CUDA one; found by a review, thirty-third
        # session), when there is one beside it
        path = os.path.join(os.path.dirname(os.path.abspath(cpu)), "libautomagic_cuda.so")
        if os.path.exists(path):
            return path
    for d in _lib.package_dirs():  # (an editable install: site-packages)
        path = os.path.join(d, "libautomagic_cuda.so")
        if os.path.exists(path):
            return path
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "libautomagic_cuda.so")


def _load():
    """The CUDA library, or None (the reason is in _load_error)."""
    global _cuda_lib, _load_error
    with _load_lock:
        if _cuda_lib is not None or _load_error is not None:
            return _cuda_lib
        path = _library_path()
        if not os.path.exists(path):
            _load_error = ("%s does not exist: this automagic was built without CUDA "
                           "(reinstall with 'pip install .' on a machine with nvcc, or "
                           "point AUTOMAGIC_CUDA_LIBRARY at a built libautomagic_cuda.so)"
                           % path)
            return None
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            _load_error = "loading %s failed: %s" % (path, e)
            return None
        try:
            lib.am_version_string.restype = ctypes.c_char_p
            found = lib.am_version_string().decode()
            for name in ("am_update_cuda", "am_cuda_workspace_bytes", "am_cuda_device_count"):
                getattr(lib, name)
        except AttributeError as e:
            # another library (a bare AttributeError was raised, again at
            # every call; found by a review, twenty-third session)
            _load_error = "%s is not libautomagic_cuda (%s)" % (path, e)
            return None
        if found != _lib.LIBRARY_VERSION:
            _load_error = ("%s is libautomagic_cuda %s; this front end needs %s (rebuild "
                           "with 'pip install .')" % (path, found, _lib.LIBRARY_VERSION))
            return None
        lib.am_update_cuda.argtypes = [
            _P(_lib.Tensor), _P(_lib.Tensor), _P(_lib.State), ctypes.c_void_p,
            _P(_lib.HParams), _lib.RngKey, ctypes.c_void_p, ctypes.c_size_t,
            ctypes.c_void_p, ctypes.c_void_p]
        lib.am_cuda_workspace_bytes.argtypes = [_P(_lib.Shape), _P(ctypes.c_size_t)]
        lib.am_cuda_device_count.argtypes = [_P(ctypes.c_int)]
        lib.am_status_string.restype = ctypes.c_char_p
        lib.am_status_string.argtypes = [ctypes.c_int]
        lib.am_set_log_callback.argtypes = [_lib.LOG_FN, ctypes.c_void_p]
        # The same callback as the CPU library: messages land in _lib's
        # thread-local "last message" and are quoted by exceptions.
        lib.am_set_log_callback(_lib._log_cb, None)
        _cuda_lib = lib
        return lib


def available() -> bool:
    """True when libautomagic_cuda is present and sees at least one device."""
    lib = _load()
    if lib is None:
        return False
    n = ctypes.c_int(0)
    return lib.am_cuda_device_count(ctypes.byref(n)) == _lib.OK and n.value > 0


def unavailable_reason() -> str:
    _load()
    return _load_error or ""


class _Buffers:
    """Per (device, stream) scratch: the workspace and the device-side report."""

    def __init__(self, device):
        self.ws = torch.empty(0, dtype=torch.uint8, device=device)
        self.report = torch.zeros(_REPORT_BYTES, dtype=torch.uint8, device=device)


def _buffers(opt, device, stream, nbytes):
    # Keyed by stream: updates queued on different streams may run at once,
    # so they must not share a workspace; and by host thread: two threads
    # queueing on one stream at once (ctypes lets go of the GIL during the
    # call) would interleave their launches on one workspace (found by a
    # review, twenty-third session).
    table = opt.__dict__.setdefault("_am_cuda_buffers", {})
    key = (device.index, stream.cuda_stream, threading.get_ident())
    buf = table.get(key)
    if buf is None:
        buf = table[key] = _Buffers(device)
    if buf.ws.numel() < nbytes:
        # Grows only when a larger parameter is seen: after the first step of
        # every parameter there is no allocation here.
        buf.ws = torch.empty(max(nbytes, 1 << 16), dtype=torch.uint8, device=device)
    return buf


def _skips(opt, device):
    # Keyed by device only, so that a count made in an eager warm-up step
    # survives a later CUDA-graph capture on another stream (a counter
    # created inside a capture would be re-zeroed by every replay).
    table = opt.__dict__.setdefault("_am_cuda_skips", {})
    t = table.get(device.index)
    if t is None:
        t = table[device.index] = torch.zeros((), dtype=torch.int64, device=device)
    return t


def nonfinite_skips(opt) -> int:
    """Updates of CUDA parameters skipped for a non-finite gradient or update
    (synchronises with the devices that hold the counts: every stream, as
    an update on a side stream adds to its count there, which .item() on
    the current stream alone did not wait for; found by a review,
    thirty-fourth session)."""
    table = opt.__dict__.get("_am_cuda_skips", {})
    total = 0
    for t in table.values():
        torch.cuda.synchronize(t.device)
        total += int(t.item())
    return total


def library_present() -> bool:
    """True when libautomagic_cuda.so is there (not loaded, no device needed)."""
    return os.path.exists(_library_path())


def refuse_capture(opt, error_cls) -> None:
    """Raises error_cls when opt's settings cannot be captured in a CUDA graph
    (the caller knows the current stream is capturing): lr_schedule='scale'
    (the scale, whatever its value now, would be fixed in the graph) and
    nonfinite='raise' (it reads each update's status on the host). step()
    asks before it updates anything, the fused path before each update."""
    if opt.lr_schedule == "scale" or opt.nonfinite == "raise":
        raise error_cls("Automagic3: a CUDA graph cannot capture this update: %s"
                        % ("lr_schedule='scale' (the scale would be fixed in the graph)"
                           if opt.lr_schedule == "scale" else
                           "nonfinite='raise' reads each update's status on the host"))


def _state_on(state, device) -> bool:
    """Whether a parameter's state exists whole on device (its step an int64
    tensor there): what an update inside a CUDA graph capture needs."""
    if not state or "lr" not in state:
        return False
    step = state.get("step")
    return (isinstance(step, torch.Tensor) and step.device == device
            and step.dtype == torch.int64
            and all(t.device == device for t in state.values() if isinstance(t, torch.Tensor)))


def update_param(opt, p: torch.Tensor, group: dict, error_cls) -> None:
    """Queues the update of CUDA parameter p from p.grad; sets p.grad = None.

    Mirrors the CPU path of Automagic3._update_param, except that whether the
    update was applied is known on the device only: lr_schedule="scale" is
    undone on the device, skips are counted there, and nonfinite="raise"
    synchronises to read the status (the only case that does)."""
    # (here: _views imports this module)
    from ._errors import NonFiniteGradientError
    from ._views import (_DTYPES, _scale_lrs, _scaled_hparams, _shape, _state_struct,
                         _unscaled_lrs)

    lib = _load()
    if lib is None:
        raise error_cls("Automagic3: parameter on device '%s': %s" % (p.device, _load_error))
    grad = p.grad
    opt._check(p, grad)
    opt._hsig(group)  # the hyperparameters, as the CPU path checks them (first)
    scale = opt._lr_scale(group)
    with torch.cuda.device(p.device):
        capturing = torch.cuda.is_current_stream_capturing()
    if capturing:
        # before anything is created or moved: in a capture, the state's
        # fills and moves would only be recorded (never run, or run again
        # at every replay), and an int tensor made from the host fails
        # (found by a review, twenty-third session)
        refuse_capture(opt, error_cls)
        if not _state_on(opt.state.get(p), p.device):
            raise error_cls(
                "Automagic3: a CUDA graph cannot capture the first update of a parameter "
                "(shape %s on %s), whose state is created or moved to the device then: "
                "run one step eagerly before capturing" % (tuple(p.shape), p.device))
    state = opt.state[p]
    if len(state) == 0:
        state = opt._init_state(p, group)
    for name in ("lr", "polarity", "exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq"):
        t = state.get(name)
        if t is not None and t.device != p.device:
            # e.g. a checkpoint loaded on the CPU: moved once.
            state[name] = t.to(p.device)
    step = state["step"]
    if not (isinstance(step, torch.Tensor) and step.device == p.device
            and step.dtype == torch.int64):
        state["step"] = step = torch.tensor(int(step), dtype=torch.int64, device=p.device)

    with torch.cuda.device(p.device):
        stream = torch.cuda.current_stream(p.device)
        # The kernels below read grad on `stream` (or, when it is not
        # contiguous, the copy below reads it there); p.grad is dropped at
        # the end, so its memory must not go back to the caching allocator
        # of the stream it was made on (backward on a side stream) before
        # they have run: recorded before the copy, which is made on `stream`
        # and recorded too. (A capture allocates from the graph's own pool.)
        if not capturing:
            grad.record_stream(stream)
        grad = grad.contiguous()
        if not capturing:
            grad.record_stream(stream)
        # scale 0: the state advances but the parameter must not move (as on
        # the CPU, the update goes to a copy that is dropped).
        target = (p if p.is_contiguous() and scale != 0.0
                  else p.clone(memory_format=torch.contiguous_format))
        shape = _shape(p)
        need = ctypes.c_size_t(0)
        lib.am_cuda_workspace_bytes(ctypes.byref(shape), ctypes.byref(need))
        buf = _buffers(opt, p.device, stream, need.value)
        pt = _lib.Tensor(target.data_ptr(), _DTYPES[p.dtype], shape)
        gt = _lib.Tensor(grad.data_ptr(), _DTYPES[grad.dtype], shape)
        st = _state_struct(p, state)
        # As the CPU path; the stored lr is divided back on the device, only
        # when the update was applied.
        hp, lr_before = _scaled_hparams(group, state, scale)
        key = _lib.RngKey(opt.seed, opt._index_of(p) & 0xFFFFFFFF)
        _lib.clear_message()
        try:
            if lr_before is not None:
                _scale_lrs(state, scale)
            status = lib.am_update_cuda(ctypes.byref(pt), ctypes.byref(gt), ctypes.byref(st),
                                        step.data_ptr(), ctypes.byref(hp), key,
                                        buf.ws.data_ptr(), buf.ws.numel(),
                                        stream.cuda_stream, buf.report.data_ptr())
            if status < 0:
                raise error_cls("Automagic3: CUDA update of a parameter of shape %s on %s "
                                "failed: %s" % (tuple(p.shape), p.device,
                                                _lib.last_message()
                                                or lib.am_status_string(status).decode()))
            dev_status = buf.report[:4].view(torch.int32)[0]
            if lr_before is not None:
                # As the CPU (_unscaled_lrs: Python-scalar arithmetic, no
                # copy from the host and no wait for the GPU), only where
                # applied.
                state["lr"].copy_(torch.where(dev_status == 0,
                                              _unscaled_lrs(state["lr"], lr_before, scale),
                                              lr_before))
                lr_before = None
        except BaseException:
            # a failed call, or an interrupt before the lrs were divided
            # back: never left scaled (after an interrupt that came once the
            # kernels were queued, the update applies with this step's lr
            # and the stored lrs are those before it: one bump lost; found
            # by a review, by reading: no GPU here)
            if lr_before is not None:
                state["lr"].copy_(lr_before)
            raise
        if opt.nonfinite == "raise":
            code = int(dev_status.item())  # synchronises: raise mode only
            if code != _lib.OK:
                raise NonFiniteGradientError(
                    "Automagic3: %s for a parameter of shape %s on %s; parameter and "
                    "state are unchanged, p.grad kept"
                    % (_lib.status_string(code), tuple(p.shape), p.device))
        # Count skipped updates on the device, in stream order (no sync).
        _skips(opt, p.device).add_(dev_status.ne(0))
        if target is not p and scale != 0.0:
            p.copy_(target)
        # The memory may have changed behind autograd's back (the host does
        # not know whether the update was applied, so always).
        torch.autograd.graph.increment_version(p)
    p.grad = None
