"""automagic.Automagic3: the PyTorch front end of libautomagic.

A drop-in for the reference ``Automagic3`` class (same constructor names and
defaults, same state keys where the meaning is the same). Each update runs in
C on the tensors' memory; state lives in ``opt.state[p]`` as torch tensors.
docs/PYTORCH.md describes the options, fused mode and checkpoints.
"""
import ctypes
import math
import threading
import warnings
import weakref
from collections import OrderedDict
from typing import List, Optional

import torch

from . import _cuda, _lib, _threads
from ._checkpoint import CheckpointError, expected_shapes, is_real_number, prepare_load
from ._fused import BackwardSteps

_DTYPES = {torch.float32: _lib.DTYPE_FLOAT32, torch.bfloat16: _lib.DTYPE_BFLOAT16,
           torch.float16: _lib.DTYPE_FLOAT16}

# Device types _update_param can hand to libautomagic ("cuda": issue 7, when
# libautomagic_cuda.so is installed; see _cuda.py).
_SUPPORTED_DEVICE_TYPES = ("cpu", "cuda") if _cuda.library_present() else ("cpu",)
_STRIDED = torch.strided

# hp.lr is validated by C but not used by an update (the per-row lrs live in
# the state), so every call passes this valid constant.
_PLACEHOLDER_LR = 1e-6

# Group keys that are Automagic3 hyperparameters: on load_state_dict the
# optimizer's own (constructor / add_param_group) values win over saved ones.
_HPARAM_KEYS = _lib.HPARAM_NAMES + ("base_lr",)

_STATE_DICT_FORMAT = 1

_threads.use_torch_threads()


class AutomagicError(RuntimeError):
    """Raised when libautomagic refuses an update (the message says why)."""


class NonFiniteGradientError(AutomagicError):
    """nonfinite="raise" and a gradient (or its update) was not finite.

    The parameter and its state are unchanged; p.grad is left in place."""


def _shape(t: torch.Tensor) -> _lib.Shape:
    s = _lib.Shape()
    s.ndim = t.dim()
    for i, d in enumerate(t.shape):
        s.dims[i] = d
    return s


def _state_sizes(t: torch.Tensor) -> _lib.StateSizes:
    sizes = _lib.StateSizes()
    status = _lib.lib.am_state_get_sizes(ctypes.byref(_shape(t)), ctypes.byref(sizes))
    if status != _lib.OK:
        raise ValueError("Automagic3: parameter of shape %s: %s"
                         % (tuple(t.shape), _lib.last_message() or _lib.status_string(status)))
    return sizes


def _check_plan_inputs(p: torch.Tensor, state: dict, same_device: bool = True) -> None:
    """Raises AutomagicError unless the C library may write p's memory and
    its state tensors as p's update: the state tensors' shapes are the C
    update's sizes for p's shape, their dtypes those the C state holds, and
    p has no element that aliases another. Runs whenever the C view of a
    parameter is (re)built: p.data replaced by a tensor of another shape, or
    a state tensor replaced, gave the library buffers smaller than it
    writes (heap corruption). same_device=False: state tensors may be on
    another device (a CUDA parameter's, moved at its update)."""
    _refuse_subclass(p, "Automagic3: a parameter of shape %s" % (tuple(p.shape),),
                     AutomagicError)
    if _has_internal_overlap(p):
        raise AutomagicError(
            "Automagic3: a parameter of shape %s has elements that share memory (an "
            "expand()ed tensor?); an update cannot write it. Use a tensor that owns "
            "its elements (e.g. .clone())" % (tuple(p.shape),))
    expected = expected_shapes(p, _state_sizes(p).polarity_bytes)
    for key, shape in expected.items():
        t = state.get(key)
        want = torch.uint8 if key == "polarity" else torch.float32
        if (not isinstance(t, torch.Tensor) or t.dtype != want or tuple(t.shape) != shape
                or (same_device and t.device != p.device) or not t.is_contiguous()):
            got = ("a %s tensor of shape %s on %s%s" % (
                t.dtype, tuple(t.shape), t.device, "" if t.is_contiguous() else
                " (not contiguous)") if isinstance(t, torch.Tensor) else repr(type(t).__name__))
            raise AutomagicError(
                "Automagic3: the state of a parameter of shape %s holds %r as %s; it must "
                "be a contiguous %s tensor of shape %s on %s. Was the parameter given "
                "another shape (p.data = ...) after its first update, or the state "
                "tensor replaced? Nothing was updated" % (
                    tuple(p.shape), key, got, want, shape, p.device))


def _has_internal_overlap(p: torch.Tensor) -> bool:
    """True when torch knows two of p's elements share memory (what its
    in-place copy_ refuses: an expand()ed tensor); False otherwise."""
    f = getattr(torch, "_debug_has_internal_overlap", None)
    if f is not None:
        return f(p) == 1  # 0: no overlap, 2: too hard to tell (copy_ allows it)
    return any(st == 0 and n > 1 for st, n in zip(p.stride(), p.shape))


def _state_struct(p: torch.Tensor, state: dict) -> _lib.State:
    """The C view (am_state) of a parameter's state tensors (checked by
    _check_plan_inputs); step left at 0."""
    _check_plan_inputs(p, state)
    st = _lib.State()
    st.lr = state["lr"].data_ptr()
    st.polarity = state["polarity"].data_ptr()
    if p.dim() >= 2:
        st.row = state["exp_avg_sq_row"].data_ptr()
        st.col = state["exp_avg_sq_col"].data_ptr()
    else:
        st.sq = state["exp_avg_sq"].data_ptr()
    return st


def _hparams(group: dict) -> _lib.HParams:
    hp = _lib.HParams()
    for name in _lib.HPARAM_NAMES:
        if name != "lr":  # (the rows' lrs are in the state; lr is checked apart)
            setattr(hp, name, float(group[name]))
    hp.lr = _PLACEHOLDER_LR
    return hp


def _plan_signature(p: torch.Tensor, state: dict, seed: int) -> tuple:
    """Everything a _Plan's structures hold: the parameter's storage, dtype and
    shape, the state tensors' storage (by address: share_memory_(), .data =
    or set_() move it without changing the tensor object), and the seed."""
    # written out, not a loop over the keys: this runs for every parameter
    # at every step (1.2 -> 0.7 us)
    try:
        if p.dim() >= 2:
            return (p.data_ptr(), p.dtype, p.shape, seed, state["lr"].data_ptr(),
                    state["polarity"].data_ptr(), state["exp_avg_sq_row"].data_ptr(),
                    state["exp_avg_sq_col"].data_ptr())
        return (p.data_ptr(), p.dtype, p.shape, seed, state["lr"].data_ptr(),
                state["polarity"].data_ptr(), state["exp_avg_sq"].data_ptr())
    except (KeyError, AttributeError, TypeError):
        # a state key missing or not a tensor (p.data given another number
        # of dims, a state entry replaced): the check says which, as
        # AutomagicError (it was a bare KeyError)
        _check_plan_inputs(p, state)
        raise


class _Plan:
    """The ctypes structures of one parameter's update, built once and
    reused: building them costs more than a small tensor's whole update."""

    __slots__ = ("sig", "pt", "gt", "st", "rep", "pt_ref", "gt_ref", "st_ref", "rep_ref",
                 "key", "workspace_bytes", "hp", "hsig", "item", "item_hp", "item_ws",
                 "held", "final_lrs")

    def __init__(self, p: torch.Tensor, state: dict, sig: tuple, key) -> None:
        self.sig = sig
        self.pt = _lib.Tensor(0, _DTYPES[p.dtype], _shape(p))
        self.gt = _lib.Tensor(0, _DTYPES[p.dtype], _shape(p))
        self.st = _state_struct(p, state)
        # The state tensors the C view points at, held: the signature knows
        # them by address, and a replacement allocated where a freed one was
        # (same address, smaller) passed unchecked and was written past its
        # end. Held, the old memory cannot be reused before the next check.
        self.held = tuple(state.values())
        self.rep = _lib.Report()
        self.pt_ref, self.gt_ref = ctypes.byref(self.pt), ctypes.byref(self.gt)
        self.st_ref, self.rep_ref = ctypes.byref(self.st), ctypes.byref(self.rep)
        self.key = key
        self.workspace_bytes = _state_sizes(p).workspace_bytes
        self.hp = None
        self.hsig = None
        # _apply's one-item am_update_batch: the item, the hyperparameters
        # it points at, its workspace bytes (a function of the shape only)
        self.item = (_lib.BatchItem * 1)()
        self.item_hp = None
        self.item_ws = None
        # the unscaled lrs a finish under lr_schedule="scale" is storing
        # (_finish_ok), for _settle to store again
        self.final_lrs = None


# am_batch_item.status as an int32 word of the item (_apply_batch reads all
# of them in one view)
_STATUS_WORD = _lib.BatchItem.status.offset // 4
assert _lib.BatchItem.status.offset % 4 == 0 and ctypes.sizeof(_lib.BatchItem) % 4 == 0


def _fill_batch_item(it, plan: "_Plan", hp) -> None:
    """Points the am_batch_item it at plan's C views and hyperparameters hp."""
    it.param = ctypes.addressof(plan.pt)
    it.grad = ctypes.addressof(plan.gt)
    it.state = ctypes.addressof(plan.st)
    it.hp = ctypes.addressof(hp)
    it.key = plan.key
    it.report = ctypes.addressof(plan.rep)


def _scaled_hparams(group: dict, state: dict, scale: float):
    """Hyperparameters of one update under lr_schedule="scale" with factor
    scale, and the stored lrs before scaling (None when scale is 0 or 1).

    clamp(s*lr*e, s*min, s*max) == s*clamp(lr*e, min, max): the clamp keeps
    bounding the tuned rate and the schedule scales what is applied. The
    stored lr is not changed here: the caller records lr_before where its
    rollback finds it, then calls _scale_lrs, and divides the lrs back after
    the update or restores lr_before if the update failed. (Scaled here, an
    interrupt before the caller had recorded lr_before left the lrs scaled,
    and a retry scaled them again; found by a review, twenty-third
    session.)"""
    hp = _hparams(group)
    lr_before = None
    if scale not in (0.0, 1.0):
        hp.min_lr *= scale
        hp.max_lr *= scale
        lr_before = state["lr"].clone()
    return hp, lr_before


def _scale_lrs(state: dict, scale: float) -> None:
    """The stored lrs times scale (see _scaled_hparams), in float64: scale
    may be below float32's normal range (max_lr > 1)."""
    state["lr"].copy_(state["lr"].double() * scale)


# float32's smallest normal value: a rate times a schedule's factor below it
# is subnormal (fewer bits) and can round to 0 (see _unscaled_lrs)
_FLT_MIN = 2.0 ** -126


def _unscaled_lrs(lr: torch.Tensor, lr_before: torch.Tensor, scale: float) -> torch.Tensor:
    """The stored lrs after an update under lr_schedule="scale" that ran
    with lr_before * scale (_scaled_hparams): lr / scale, in float64 (scale
    may be tiny); rows whose scaled rate was below float32's normal range
    keep lr_before (no bump that step: their scaled rate, and so the bump
    read back from it, had lost precision or was 0, and dividing it back
    gave a wrong rate, 0, or NaN; what such a row applied, under 2^-126, moves
    no parameter larger than about 1e-30)."""
    kept = lr_before.double() * scale < _FLT_MIN
    return torch.where(kept, lr_before, (lr.double() / scale).float())


def _validate_group(group: dict, check_lr: bool = True) -> None:
    """check_lr=False once the group exists: then group["lr"] belongs to the
    schedule (checked by _lr_scale), not to the C hyperparameters."""
    for name in _lib.HPARAM_NAMES:
        v = group[name]
        if name == "lr" and not check_lr:
            continue
        if name == "lr" and isinstance(v, torch.Tensor) and v.numel() == 1 \
                and v.is_floating_point():
            continue  # (a one-element tensor lr, as the constructor takes)
        if not is_real_number(v):
            raise TypeError("Automagic3: %s must be a number, got %r" % (name, v))
    hp = _hparams(group)
    if check_lr:
        hp.lr = float(group["lr"])
    _lib.clear_message()
    status = _lib.lib.am_hparams_validate(ctypes.byref(hp))
    if status != _lib.OK:
        raise ValueError("Automagic3: " + (_lib.last_message() or _lib.status_string(status)))


def _group_key(group: dict):
    """The values of a group's C hyperparameters but lr (a schedule's, see
    _validate_group) when every one is a plain int or float, else None:
    step() validates a group again only when this changed (measured: the
    Python part of a one-tensor step() 73 -> 46 us)."""
    vals = tuple([group[name] for name in _lib.HPARAM_NAMES if name != "lr"])
    return vals if all(type(v) is float or type(v) is int for v in vals) else None


def _add_automagic_entry(opt, sd: dict) -> None:
    """A state_dict post hook, registered first: the front end's own entry
    (a module function, so that the optimizer's hook dict holds no
    reference to it)."""
    sd["automagic"] = opt._automagic_entry()


def _weak_on_close(opt):
    """opt._on_step_closed through a weak reference: a bound method kept by
    opt's BackwardSteps made a cycle, so a dropped optimizer lived (and its
    hooks went on updating) until the cyclic garbage collector ran."""
    ref = weakref.ref(opt)

    def on_close(ended: bool) -> None:
        o = ref()
        if o is not None:
            o._on_step_closed(ended)
    return on_close


def _remove_hooks(handles: list) -> None:
    """Removes the hooks of handles, emptying the list (also the finalizer
    of an optimizer, which holds this list)."""
    for h in handles:
        h.remove()
    handles.clear()


def _refuse_subclass(p: torch.Tensor, where: str, error) -> None:
    """Refuses a tensor whose memory is not its own elements: a DTensor
    (FSDP2's fully_shard, tensor parallelism) or another wrapper subclass,
    which has no data pointer (the C update said "param data is NULL")."""
    if p.numel() == 0 or p.data_ptr() != 0:
        return
    if "DTensor" in [c.__name__ for c in type(p).__mro__]:
        raise error("%s is a DTensor (FSDP2's fully_shard or tensor parallelism): sharded "
                    "parameters are not supported (README, Known limits); use "
                    "DistributedDataParallel with fused=False" % where)
    raise error("%s is a %s whose elements have no memory address of their own (a tensor "
                "subclass); only plain tensors can be updated" % (where, type(p).__name__))


def _check_param(p, index: int) -> None:
    """Refuses, at construction, a parameter no update could handle."""
    where = "Automagic3: parameter %d (shape %s)" % (index, tuple(getattr(p, "shape", ())))
    if not isinstance(p, torch.Tensor):
        raise TypeError("%s is a %s, not a torch.Tensor" % (where, type(p).__name__))
    if p.device.type not in _SUPPORTED_DEVICE_TYPES:
        raise ValueError("%s is on device '%s'; this build updates %s tensors only"
                         % (where, p.device, "/".join(_SUPPORTED_DEVICE_TYPES)))
    if p.dtype not in _DTYPES:
        raise TypeError("%s has dtype %s; supported: float32, bfloat16, float16 "
                        "(float64 would be rounded to float32 every step)" % (where, p.dtype))
    if p.dim() > _lib.AM_MAX_DIMS:
        raise ValueError("%s has %d dims; at most %d are supported"
                         % (where, p.dim(), _lib.AM_MAX_DIMS))
    if p.is_sparse or p.layout != torch.strided:
        raise ValueError("%s has layout %s; only dense (strided) parameters" % (where, p.layout))
    _refuse_subclass(p, where, ValueError)
    if _has_internal_overlap(p):
        raise ValueError("%s has elements that share memory (an expand()ed tensor?); an "
                         "update cannot write it. Use a tensor that owns its elements "
                         "(e.g. .clone())" % where)


class Automagic3(torch.optim.Optimizer):
    """Automagic3 with the update computed by libautomagic.

    Arguments as in the reference, plus (keyword-only):
      seed:  keys the stochastic rounding of bfloat16/float16 parameters
             (with the parameter's index and step: reproducible whatever the
             thread count).
      fused: True (default) updates each parameter inside backward the moment
             its gradient is accumulated, like the reference; False leaves
             gradients to ``step()`` (needed for clip_grad_norm_, GradScaler,
             data-parallel reduction).
      accumulation_steps: fused mode only: update once per this many backward
             passes with the summed gradient (step mode: call step() once per
             k backward passes instead).
      nonfinite: "skip" (default): a gradient with a NaN/Inf leaves the
             parameter and state as they were (counted, warned once);
             "raise": raise NonFiniteGradientError instead.
      lr_schedule: "ignore" (default, as the reference): group["lr"] only
             sets where a parameter's rows start, at its first update
             (warned once if a scheduler changes it); "scale": each row's
             applied lr is multiplied by group["lr"] / initial lr.
    """

    def __init__(self, params, lr: float = 1e-6, min_lr: float = 1e-8,
                 max_lr: float = 1e-2, lr_bump_rate: float = 0.1,
                 beta2: float = 0.999, eps: float = 1e-30,
                 clip_threshold: float = 1.0, weight_decay: float = 0.0, *,
                 seed: int = 0, fused: bool = True, accumulation_steps: int = 1,
                 nonfinite: str = "skip", lr_schedule: str = "ignore"):
        # a one-element tensor too, as torch's optimizers and the reference
        # take (a schedule may change it in place: lr_schedule="scale")
        if not (is_real_number(lr) or (
                isinstance(lr, torch.Tensor) and lr.numel() == 1 and lr.is_floating_point())):
            raise TypeError("Automagic3: lr must be a number, got %r" % (lr,))
        # compared as the reference compares it, in lr's own type: a float32
        # tensor or numpy float32 of 1e-3 is not above 1e-3 there (as a
        # Python float it is 1.0000000475e-3, and was forced; found by a
        # review, twenty-fourth session)
        if bool(lr > 1e-3):
            warnings.warn("Automagic3: start lr %.9g is very high; forcing to 1e-6 "
                          "(as the reference does)" % float(lr), stacklevel=2)
            lr = 1e-6
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 64:
            raise ValueError("Automagic3: seed must be an int in [0, 2**64), got %r" % (seed,))
        if not isinstance(fused, bool):
            raise TypeError("Automagic3: fused must be True or False, got %r" % (fused,))
        if (isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int)
                or accumulation_steps < 1):
            raise ValueError("Automagic3: accumulation_steps must be an int >= 1, got %r"
                             % (accumulation_steps,))
        if accumulation_steps > 1 and not fused:
            raise ValueError("Automagic3: accumulation_steps applies to fused mode; in step "
                             "mode call step() once every %d backward passes"
                             % accumulation_steps)
        if nonfinite not in ("skip", "raise"):
            raise ValueError("Automagic3: nonfinite must be 'skip' or 'raise', got %r"
                             % (nonfinite,))
        if lr_schedule not in ("ignore", "scale"):
            raise ValueError("Automagic3: lr_schedule must be 'ignore' or 'scale', got %r"
                             % (lr_schedule,))
        self.seed = seed
        self.fused = fused
        self.accumulation_steps = accumulation_steps
        self.nonfinite = nonfinite
        self.lr_schedule = lr_schedule
        self.nonfinite_skips = 0
        # step() with more than one thread: every CPU parameter in one
        # am_update_batch call (whole parameters on separate threads, the
        # same bits; docs/PYTORCH.md "Threads"). False: one at a time.
        self.batch_updates = True
        # fused mode: small CPU parameters' updates queued (the property)
        self._fused_batch_bytes = 4 << 20
        self._init_runtime()
        defaults = dict(lr=lr, min_lr=min_lr, max_lr=max_lr, lr_bump_rate=lr_bump_rate,
                        beta2=beta2, eps=eps, clip_threshold=clip_threshold,
                        weight_decay=weight_decay)
        for k, v in defaults.items():  # (numpy scalars as floats: see add_param_group)
            if type(v) not in (int, float) and is_real_number(v):
                defaults[k] = float(v)
        try:
            super().__init__(params, defaults)
            self.register_state_dict_post_hook(_add_automagic_entry, prepend=True)
        except BaseException:
            # torch adds the groups one at a time, each registering its
            # hooks: a group refused after others leaves no hook behind
            # (the half-built optimizer, kept alive by a traceback, would
            # update and consume those parameters' gradients)
            _remove_hooks(self._hook_handles)
            self._hooked = set()
            raise
        if fused and torch.distributed.is_available() and torch.distributed.is_initialized() \
                and torch.distributed.get_world_size() > 1:
            warnings.warn("Automagic3: fused=True updates each parameter inside backward, "
                          "before data-parallel gradient reduction; use fused=False and "
                          "call step() after backward", UserWarning, stacklevel=2)

    @property
    def fused_batch_bytes(self) -> int:
        """Fused mode: CPU parameters whose gradient is at most a quarter of
        this are queued and updated together when the queued gradients
        reach it, and at the end of backward (docs/PYTORCH.md); 0: every
        parameter in its own hook."""
        return self._fused_batch_bytes

    @fused_batch_bytes.setter
    def fused_batch_bytes(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError("Automagic3: fused_batch_bytes must be an int >= 0, got %r"
                             % (value,))
        self._fused_batch_bytes = value

    def _init_runtime(self) -> None:
        """Attributes that are rebuilt, not copied, by pickle and deepcopy."""
        self._hook_handles = []
        self._hook_cdata = {}          # index -> p._cdata when its hook was registered
        self._hook_ids = {}            # index -> its hook's handle id
        # the hooks hold no strong reference to the optimizer (_make_hook):
        # when it is collected, its hooks are removed from the parameters
        weakref.finalize(self, _remove_hooks, self._hook_handles)
        self._hooked = set()           # indices of parameters with a hook
        self._param_index = {}         # parameter -> index (its rng param_id)
        self._listed = -1              # parameters the groups listed at the last scan
        self._tls = threading.local()  # per-thread workspace
        self._steps = BackwardSteps(_weak_on_close(self))
        self._micro = 0                # backward passes done in this window
        # fused mode: whether every step() so far came at a window's end
        # (None: not known yet; see step()), and the backward passes since
        # the last step()
        self._aligned_steps = None
        self._passes = 0
        self._updated = set()          # indices updated in this window
        # indices whose hook fired in this window (None: not known, after a
        # state_dict was loaded or the optimizer unpickled mid-window)
        self._window_fired = set()
        self._deferred = set()         # indices whose hook fires twice a step
        self._warned = set()           # one-time warnings already given
        self._skipped = {}             # index -> non-finite updates skipped
        self._plans = {}               # index -> _Plan (C views of one parameter)
        self._valid_groups = {}        # id(group) -> _group_key last validated
        self._hsig_seen = {}           # id(group) -> _hsig last checked
        self._batch_cache = {}         # _apply_batch's items, by caller's key
        self._queue = []               # fused mode: small updates not yet run
        self._queue_bytes = 0          # their gradients' bytes
        self._batches = 0              # queues run in this step

    def _warn_once(self, key: str, msg: str, category=UserWarning) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn("Automagic3: " + msg, category, stacklevel=3)

    # ----------------------------------------------------------- groups
    def add_param_group(self, param_group: dict) -> None:
        # Everything is checked before the group is added, so a refused
        # group leaves the optimizer as it was.
        if not isinstance(param_group, dict):
            raise TypeError("Automagic3: a parameter group must be a dict, got %s"
                            % type(param_group).__name__)
        param_group = dict(param_group)
        params = param_group["params"]
        if isinstance(params, torch.Tensor):
            params = [params]
        elif isinstance(params, set):
            raise TypeError("Automagic3: parameters must be an ordered collection (their "
                            "order keys the randomness and the state_dict), not a set")
        params = list(params)
        # model.named_parameters(): (name, tensor) pairs, which torch's
        # add_param_group turns into the group's "param_names"
        named = [isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in params]
        if any(named) and not all(named):
            raise ValueError("Automagic3: a group's parameters must all be named (name, "
                             "tensor) pairs or all tensors, not a mix")
        tensors = [p[1] for p in params] if any(named) else params
        # The same tensor twice in a group: torch only warns (and the
        # reference updates it once per step); kept once here, so that it is
        # updated once (a second entry found its gradient already consumed).
        seen, keep = set(), []
        for i, p in enumerate(tensors):
            if isinstance(p, torch.Tensor) and id(p) in seen:
                continue
            seen.add(id(p))
            keep.append(i)
        if len(keep) != len(params):
            warnings.warn("Automagic3: a parameter group lists %d parameter(s) more than once; "
                          "each is kept once (updated once per step)"
                          % (len(params) - len(keep)), stacklevel=2)
            params = [params[i] for i in keep]
            tensors = [tensors[i] for i in keep]
        param_group["params"] = params
        # numpy scalars and other numbers.Real as plain floats: kept as they
        # were, a state_dict did not load under torch.load(weights_only=True)
        for name in _lib.HPARAM_NAMES:
            v = param_group.get(name)
            if type(v) not in (int, float) and is_real_number(v):
                param_group[name] = float(v)
        probe = dict(param_group)
        for k, v in self.defaults.items():
            probe.setdefault(k, v)
        _validate_group(probe)
        # A group's own lr above 1e-3 is kept, as in the reference, which
        # forces only the constructor's lr (SPEC 1)
        for i, p in enumerate(tensors):
            _check_param(p, len(self._param_index) + i)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        group.setdefault("base_lr", float(group["lr"]))
        self._register_params(group)

    def _adopt_listed(self, force: bool = False) -> None:
        """Registers the parameters a script put into a group's "params" by
        hand (torch's optimizers update them; the reference creates their
        state at their first update): checked as add_param_group checks,
        given the next indices, no backward hook (in fused mode step()
        updates them, as any parameter without a hook). Scans only when the
        number of listed parameters changed, or when forced (a parameter
        replaced in place in a list was found unregistered)."""
        listed = sum(len(g["params"]) for g in self.param_groups)
        if listed == self._listed and not force:
            return
        for group in self.param_groups:
            for p in group["params"]:
                if p not in self._param_index:
                    try:
                        _check_param(p, len(self._param_index))
                    except (TypeError, ValueError) as e:
                        raise AutomagicError(str(e) + " (put into param_groups by hand; "
                                             "add_param_group checks it)") from None
                    self._param_index[p] = len(self._param_index)
        self._listed = listed

    def _index_of(self, p: torch.Tensor) -> int:
        """p's index, registering a parameter put into a group by hand."""
        index = self._param_index.get(p)
        if index is None:
            self._adopt_listed(force=True)
            index = self._param_index.get(p)
            if index is None:
                raise AutomagicError("Automagic3: a parameter of shape %s is in no parameter "
                                     "group" % (tuple(p.shape),))
        return index

    def _register_params(self, group: dict) -> None:
        for pos, p in enumerate(group["params"]):
            index = len(self._param_index)
            self._param_index[p] = index
            if self.fused and p.requires_grad:
                self._hooked.add(index)
                handle = p.register_post_accumulate_grad_hook(self._make_hook(group, pos, index))
                self._hook_handles.append(handle)
                self._hook_ids[index] = handle.id
                self._hook_cdata[index] = p._cdata

    def _rehook_swapped(self, ps) -> set:
        """Of ps (parameters with a gradient, fused mode), the ids of those
        whose tensor was swapped since their hook was registered
        (torch.utils.swap_tensors: model.to() or half() under
        torch.__future__.set_swap_module_params_on_conversion(True),
        load_state_dict(assign=True)). The swap keeps the Parameter object
        and its dict of post-accumulate-grad hooks, but that dict is no
        longer attached to the new tensor: no hook fires, so fused training
        stopped silently (found by a review, twenty-second session). The
        dict is attached again (torch attaches it when the attribute is
        set), which revives the user's own hooks too; ours is registered
        anew if it is not in it."""
        out, index_of, hooked, cdata = set(), self._param_index, self._hooked, self._hook_cdata
        for p in ps:
            index = index_of.get(p)
            if index is None or index not in hooked or cdata.get(index) == p._cdata:
                continue
            hooks = p._post_accumulate_grad_hooks
            p._post_accumulate_grad_hooks = None
            p._post_accumulate_grad_hooks = hooks if hooks is not None else OrderedDict()
            if self._hook_ids.get(index) not in p._post_accumulate_grad_hooks:
                group = next((g for g in self.param_groups
                              if any(q is p for q in g["params"])), None)
                if group is None:
                    continue
                pos = next(i for i, q in enumerate(group["params"]) if q is p)
                handle = p.register_post_accumulate_grad_hook(self._make_hook(group, pos, index))
                self._hook_handles.append(handle)
                self._hook_ids[index] = handle.id
            cdata[index] = p._cdata
            out.add(id(p))
        return out

    def _make_hook(self, group, pos, index):
        # Neither the optimizer nor the group (which lists p) held strongly:
        # the garbage collector does not look into a tensor's hooks, so
        # p -> hook -> optimizer -> p was a cycle never collected (the
        # optimizer, its state and the model stayed alive after del, and an
        # optimizer created again for the same model found the old one's
        # hooks still updating it). The group is found by identity, and
        # taken only if it still lists p at position pos (a load_state_dict
        # refills the same dicts): a dict created after the group's was
        # freed may have its id (CPython reuses addresses), and a parameter
        # may have been moved to another group by hand.
        ref, gid = weakref.ref(self), id(group)

        def _hook(p: torch.Tensor) -> None:
            nonlocal gid, pos
            opt = ref()
            if opt is None:
                return
            for g in opt.param_groups:
                if id(g) == gid:
                    ps = g["params"]
                    if pos < len(ps) and ps[pos] is p:
                        opt._on_grad_ready(p, g, index)
                        return
                    break
            # the group dict was replaced (param_groups[i] = dict(...)) or
            # its list changed: the one that lists p now
            for g in opt.param_groups:
                for i, q in enumerate(g["params"]):
                    if q is p:
                        gid, pos = id(g), i
                        opt._on_grad_ready(p, g, index)
                        return
            opt._warn_once("nogroup", "a parameter of shape %s with a backward hook is in no "
                           "parameter group: not updated" % (tuple(p.shape),))
        return _hook

    # ----------------------------------------------------------- fused
    def _on_grad_ready(self, p: torch.Tensor, group: dict, index: int) -> None:
        """A hook fired for parameter index: update now, queue a small CPU
        parameter's update for the next batch, or leave p.grad to
        accumulate."""
        steps = self._steps
        task = steps.enter()
        batch = key = None
        with steps.lock:
            if index in steps.fired:
                # Second hook in one step: a weight used on both sides of a
                # reentrant checkpoint. From now on wait for the end of the
                # backward pass to update it with the whole gradient.
                self._deferred.add(index)
                if any(q is p for q, _ in self._queue):
                    return  # not updated yet: p.grad now holds both parts
                if index in self._updated:
                    p.grad = None
                    self._warn_once(
                        "twice", "the gradient of a parameter of shape %s arrived in "
                        "two parts in one backward pass (a weight shared across a "
                        "reentrant checkpoint?). It was updated once, with the first "
                        "part; the second was dropped. From the next step on it is "
                        "updated at the end of backward with its whole gradient "
                        "(warned once)" % (tuple(p.shape),))
                    return
            steps.fired.add(index)
            if self._window_fired is not None:
                self._window_fired.add(index)
            if (self._micro + 1 < self.accumulation_steps or index in self._deferred
                    or index in self._updated):
                return  # applied by _flush when the window closes
            self._updated.add(index)
            grad = p.grad
            # Queued only where the end of backward is sure to run the
            # queue (BackwardSteps.can_queue)
            if (grad is not None and p.is_cpu and self.nonfinite != "raise"
                    and steps.can_queue(task)):
                nbytes = grad.nbytes
                if 0 < nbytes <= self._fused_batch_bytes // 4:
                    self._queue.append((p, group))
                    self._queue_bytes += nbytes
                    if self._queue_bytes < self._fused_batch_bytes:
                        return
                    batch, key = self._take_queue()
        if batch is not None:
            self._run_queue(batch, key)
        else:
            self._update_param(p, group)

    def _take_queue(self):
        """(the queued updates, their batch's number in this step), the
        queue emptied; the lock held."""
        batch = self._queue
        self._queue, self._queue_bytes = [], 0
        self._batches += 1
        return batch, self._batches

    def _run_queue(self, batch, key) -> None:
        """Runs queued updates [(p, group)] in one am_update_batch call (the
        same bits as one at a time; one at a time when batch_updates is
        False). A parameter that cannot be updated
        keeps its gradient; the others are updated, then the first error is
        raised, as hooks one after another would have."""
        jobs, error, hyper = [], None, {}
        with torch.no_grad():
            for p, group in batch:
                if p.grad is None:  # dropped since it was queued
                    continue
                try:
                    self._check(p, p.grad)
                    if not self.batch_updates:  # one at a time: each checked first
                        self._precheck_plan(p, group)
                    if id(group) not in hyper:
                        hyper[id(group)] = (self._lr_scale(group), self._hsig(group))
                except AutomagicError as e:
                    error = error or e
                    continue
                jobs.append((p, group) + hyper[id(group)])
            _lib.lib.am_set_num_threads(torch.get_num_threads())
            # the key-th batch of each step keeps its own item array
            try:
                self._apply_jobs(jobs, ("fused", key))
            except AutomagicError as e:
                # one refused while the batch call was prepared (nothing ran:
                # _prepare_calls puts back what it changed): the others run
                # without it (they were all kept waiting; found by a review,
                # twenty-second session). Looked for only then: a check of
                # every queued parameter first cost 0.5 us each.
                if not self.batch_updates or len(jobs) < 2:
                    raise
                error = error or e
                good = []
                for job in jobs:
                    try:
                        self._precheck_plan(job[0], job[1])
                        good.append(job)
                    except AutomagicError:
                        pass
                if len(good) == len(jobs):
                    raise
                self._apply_jobs(good, ("fused", key))
        if error is not None:
            raise error

    def _on_step_closed(self, ended: bool) -> None:
        """A step closed: the queued updates run if its backward pass ended
        (ended) or is still running (a hook of another pass closed it), else
        they are dropped (the pass raised: running them now could change
        weights a later forward has used); maybe the window ends too."""
        batch, key = self._take_queue()
        self._batches = 0
        try:
            if batch and (ended or self._steps.pass_running()):
                self._run_queue(batch, key)
            elif batch:
                warnings.warn(
                    "Automagic3: a backward pass did not reach its end (an exception "
                    "inside backward?): the updates of %d parameters queued in it were not "
                    "run. Their gradients are kept in .grad, and a later backward pass adds "
                    "to them as PyTorch accumulates; call zero_grad() to drop them"
                    % len(batch), RuntimeWarning, stacklevel=4)
        finally:
            self._count_micro_step()

    def _count_micro_step(self) -> None:
        self._passes += 1
        self._micro += 1
        if self._micro < self.accumulation_steps:
            return
        self._close_window(flush=True)

    def _close_window(self, flush: bool) -> None:
        """Ends the accumulation window: with flush, its gradients applied
        (_flush); without, dropped by the caller (zero_grad)."""
        self._micro = 0
        try:
            if flush:
                self._flush()
        finally:
            self._updated.clear()
            self._window_fired = set()

    def _flush(self) -> None:
        """Updates hooked parameters whose hook fired in this window and
        whose gradient is not yet applied (deferred ones, and those whose
        hook fired in an earlier micro-batch of the window but not in the
        last). A gradient no hook reported (set by hand, or left from before)
        is left alone, as the reference leaves it."""
        fired = self._window_fired
        for group in self.param_groups:
            for p in group["params"]:
                index = self._param_index.get(p)  # (None: put in by hand, no hook)
                if (p.grad is not None and index in self._hooked and index not in self._updated
                        and (fired is None or index in fired)):
                    self._updated.add(index)
                    self._update_param(p, group)

    # ------------------------------------------------------------ state
    def _start_lr(self, group: dict) -> float:
        """The lr a parameter's rows start from at its first update. "scale":
        the group's start lr (group["lr"] is the schedule's factor). "ignore":
        group["lr"] as it is then, as the reference does (a scheduler's or a
        script's change before a parameter's first update sets where its
        rows start; after it, group["lr"] is not used)."""
        if self.lr_schedule == "scale":
            return float(group["base_lr"])
        lr = float(group["lr"])  # a number or a one-element tensor (_lr_scale checked)
        if not (math.isfinite(lr) and lr >= 0.0):
            raise AutomagicError("Automagic3: group['lr'] = %r cannot start a parameter's "
                                 "rows: it must be finite and >= 0" % (group["lr"],))
        return lr

    def _init_state(self, p: torch.Tensor, group: dict, start: Optional[float] = None) -> dict:
        # built whole, then stored: a start lr refused (_start_lr raises) left
        # {'step': 0} behind, and every later step() failed on its missing
        # 'lr' (found by a review, twenty-second session)
        sizes = _state_sizes(p)
        f32 = dict(dtype=torch.float32, device=p.device)
        lr_shape = (p.shape[0],) if p.dim() >= 2 else p.shape
        if start is None:
            start = self._start_lr(group)
        new = {"step": 0, "lr": torch.full(lr_shape, start, **f32),
               "polarity": torch.zeros(sizes.polarity_bytes, dtype=torch.uint8,
                                       device=p.device)}
        if p.dim() >= 2:
            new["exp_avg_sq_row"] = torch.zeros(p.shape[:-1], **f32)
            new["exp_avg_sq_col"] = torch.zeros(p.shape[:-2] + p.shape[-1:], **f32)
        else:
            new["exp_avg_sq"] = torch.zeros(p.shape, **f32)
        state = self.state[p]
        state.update(new)
        return state

    def _workspace(self, nbytes: int):
        """(address, bytes) of this thread's workspace, grown to nbytes."""
        ws = getattr(self._tls, "ws", None)
        if ws is None or ws[1] < nbytes:
            t = torch.empty(max(nbytes, 4096), dtype=torch.uint8)
            ws = (t.data_ptr(), t.numel(), t)  # the tensor keeps the memory alive
            self._tls.ws = ws
        return ws[0], ws[1]

    # ----------------------------------------------------------- update
    def _check(self, p: torch.Tensor, grad: torch.Tensor) -> bool:
        """Raises AutomagicError when p cannot be updated with grad; True for
        a CPU parameter, False for a CUDA one."""
        if (grad.layout is _STRIDED and p.is_cpu and grad.is_cpu and p.dtype in _DTYPES
                and grad.dtype in _DTYPES and grad.shape == p.shape
                and p.dim() <= _lib.AM_MAX_DIMS):
            return True  # the common case in one test (1.2 -> 0.5 us a parameter)
        if p.device.type not in _SUPPORTED_DEVICE_TYPES:
            raise AutomagicError(
                "Automagic3: parameter on device '%s' is not supported; this build "
                "updates %s tensors" % (p.device, "/".join(_SUPPORTED_DEVICE_TYPES)))
        if grad.is_sparse or grad.layout != torch.strided:
            raise AutomagicError("Automagic3 does not support sparse gradients (got a %s "
                                 "gradient for a parameter of shape %s; use a dense "
                                 "gradient, e.g. nn.Embedding(sparse=False))"
                                 % (grad.layout, tuple(p.shape)))
        if grad.device != p.device:
            raise AutomagicError("Automagic3: gradient on %s for a parameter on %s"
                                 % (grad.device, p.device))
        if p.dtype not in _DTYPES:
            raise AutomagicError("Automagic3: parameter dtype %s is not supported "
                                 "(float32, bfloat16, float16)" % p.dtype)
        if grad.dtype not in _DTYPES:
            raise AutomagicError("Automagic3: gradient dtype %s is not supported "
                                 "(float32, bfloat16, float16)" % grad.dtype)
        if grad.shape != p.shape:
            raise AutomagicError("Automagic3: gradient shape %s differs from the "
                                 "parameter's %s" % (tuple(grad.shape), tuple(p.shape)))
        if p.dim() > _lib.AM_MAX_DIMS:
            raise AutomagicError("Automagic3: %d-D parameters are not supported "
                                 "(at most %d dims)" % (p.dim(), _lib.AM_MAX_DIMS))
        return p.is_cpu

    def _lr_scale(self, group: dict) -> float:
        """The factor applied to every row's lr (1.0 unless lr_schedule="scale")."""
        lr, base = group["lr"], group.get("initial_lr", group["base_lr"])
        if isinstance(lr, torch.Tensor) and lr.numel() == 1 and lr.is_floating_point():
            lr = float(lr)
        elif not is_real_number(lr):
            raise AutomagicError("Automagic3: group['lr'] must be a number (or a one-element "
                                 "floating tensor), got %r" % (lr,))
        if self.lr_schedule == "ignore":
            # (to float32's precision: a schedule's tensor lr holds the same
            # value in float32, which warned "changed from 4e-05 to 4e-05")
            if not (math.isclose(lr, group["base_lr"], rel_tol=1e-6)
                    or math.isclose(lr, base, rel_tol=1e-6)):
                self._warn_once("schedule", "group['lr'] changed from %g to %g (an lr "
                                "scheduler?) but, as in the reference, it is not applied: "
                                "each row tunes its own lr (group['lr'] only sets where the "
                                "rows of a parameter not yet updated start). Pass "
                                "lr_schedule='scale' to apply the schedule (warned once)"
                                % (base, lr))
            return 1.0
        scale = float(lr) / float(base)
        if not math.isfinite(scale) or scale < 0:
            raise AutomagicError("Automagic3: lr_schedule='scale' needs group['lr'] >= 0 and "
                                 "a positive initial lr, got lr=%r, initial lr=%r" % (lr, base))
        if 0.0 < scale and scale * max(float(group["max_lr"]), float(group["base_lr"])) < _FLT_MIN:
            # every scaled rate below float32's normal range: applied as 0
            # (the parameter stays; state, lrs and step advance unscaled)
            self._warn_once("tinyscale", "lr_schedule='scale': the factor %g takes every "
                            "rate of a group below float32's range (2^-126): such a "
                            "factor is applied as 0, the parameters do not move "
                            "(warned once)" % scale)
            return 0.0
        return scale

    def _hsig(self, group: dict) -> tuple:
        """The group's hyperparameter values: values, not objects, since a
        hyperparameter held in a tensor may change in place. lr may be a
        tensor (a schedule's, see _validate_group); the others must be plain
        numbers, as step() checks (_validate_group), checked here whenever
        the values differ from the last ones seen for the group (a hook took
        float() of a string or a tensor set after construction)."""
        try:
            sig = tuple([float(group[name]) for name in _lib.HPARAM_NAMES])
        except (TypeError, ValueError):
            sig = None
        if sig is None or self._hsig_seen.get(id(group)) != sig:
            for name in _lib.HPARAM_NAMES[1:]:
                v = group[name]
                if not is_real_number(v):
                    raise AutomagicError("Automagic3: %s must be a number, got %r" % (name, v))
            if sig is None:  # lr: neither a number nor a tensor of one
                raise AutomagicError("Automagic3: lr must be a number, got %r" % (group["lr"],))
            self._hsig_seen[id(group)] = sig
        return sig

    def _update_param(self, p: torch.Tensor, group: dict) -> None:
        """Updates one parameter (a backward hook, or the end of a fused
        window) under no_grad. Hooks run inside backward, where grad mode is
        already off unless create_graph=True: no context to enter then (it
        was 1 us of the 5 a small parameter's hook cost)."""
        if p.grad is None:
            return
        if torch.is_grad_enabled():
            with torch.no_grad():
                self._update_one(p, group)
        else:
            self._update_one(p, group)

    def _update_one(self, p: torch.Tensor, group: dict) -> None:
        """_update_param's work, grad mode off: checks, then _apply."""
        if p.is_cuda:  # CUDA path (issue 7): python/automagic/_cuda.py
            _cuda.update_param(self, p, group, AutomagicError)
            return
        self._check(p, p.grad)
        _lib.lib.am_set_num_threads(torch.get_num_threads())
        self._apply(p, group, self._lr_scale(group), self._hsig(group))

    def _apply(self, p: torch.Tensor, group: dict, scale: float, hsig: tuple) -> None:
        """The update of a checked CPU parameter with a gradient, under
        no_grad, with the thread count already set; scale is _lr_scale(group)
        and hsig _hsig(group). step() calls it directly for each parameter
        after checking them all (the fixed cost per parameter is most of a
        small tensor's update)."""
        calls = []
        try:
            # (prepared inside: an interrupt as _prepare_calls returns left
            # scaled lrs out of _settle's reach; found by a review)
            self._prepare_calls([(p, group, scale, hsig)], calls)
            self._apply_call(calls[0])
        except BaseException:
            self._settle(calls)
            raise

    def _apply_call(self, call) -> None:
        """_apply's C call and finish for its prepared call."""
        plan, hp = call[1], call[4]
        # am_update_batch of one item: am_update, bit for bit (batch.c),
        # with four plain arguments instead of eight through ctypes (0.9 us
        # a call instead of 1.5)
        item = plan.item
        if plan.item_hp is not hp:  # (new every update under lr_schedule="scale")
            _fill_batch_item(item[0], plan, hp)
            plan.item_hp = hp
        _lib.clear_message()
        status = _lib.OK
        if plan.item_ws is None:
            nb = ctypes.c_size_t(0)
            status = _lib.lib.am_update_batch_workspace(item, 1, 1, ctypes.byref(nb))
            if status == _lib.OK:
                plan.item_ws = nb.value
        if status == _lib.OK:
            ws_ptr, ws_bytes = self._workspace(plan.item_ws)
            status = _lib.lib.am_update_batch(item, 1, ws_ptr, ws_bytes)
            if status == _lib.OK:
                status = item[0].status
        self._finish_call(call, status)

    def _precheck_plan(self, p: torch.Tensor, group: dict) -> None:
        """Raises AutomagicError when _prepare_calls would refuse p: its C
        view (its state or p.data changed since it was built), or, before
        its first update, the group's start lr."""
        state = self.state.get(p) if p in self.state else None
        if not state:
            self._start_lr(group)  # (the state is created whole at the update)
            return
        if p.is_cuda:  # (its state may still be on the CPU: moved at its update)
            _check_plan_inputs(p, state, same_device=False)
            return
        index = self._param_index.get(p)
        plan = self._plans.get(index) if index is not None else None
        if plan is None or plan.sig != _plan_signature(p, state, self.seed):
            _check_plan_inputs(p, state)

    def _prepare_calls(self, jobs, calls: list) -> None:
        """The C views of the updates of jobs [(p, group, scale, hsig)],
        pointed at their data, appended to calls: a call (p,
        plan, target, grad, hp, lr_before, state, scale, the state's step
        before the update) each; grad and target must stay alive until the
        update has run. A parameter's _Plan is rebuilt whenever anything it holds may
        have changed (p.data replaced, state tensors replaced or moved, the
        seed), its hyperparameters when the group's values (hsig) changed.
        One loop with its names local, no call per parameter: this runs for
        every parameter at every step (2.4 -> 1.6 us a parameter). A job
        refused midway (its state or p.data changed) raises; the callers'
        _settle puts the lrs of the calls already prepared back from their
        schedule's scaling (they were left scaled, once more at every retry;
        found by a review, twenty-second session)."""
        state_of, plans, index_of, seed = self.state, self._plans, self._param_index, self.seed
        for p, group, scale, hsig in jobs:
            grad = p.grad
            state = state_of[p]
            if not state:
                state = self._init_state(p, group)
            if not grad.is_contiguous():
                grad = grad.contiguous()
            # scale 0: the state advances but the parameter must not move, so
            # the update is written to a copy that is then dropped.
            # (one copy: contiguous() of a channels_last p is one already)
            target = (p if scale != 0.0 and p.is_contiguous()
                      else p.clone(memory_format=torch.contiguous_format))
            index = index_of.get(p)
            if index is None:
                index = self._index_of(p)
            plan = plans.get(index)
            sig = _plan_signature(p, state, seed)
            if plan is None or plan.sig != sig:
                plan = plans[index] = _Plan(p, state, sig,
                                            _lib.RngKey(seed, index & 0xFFFFFFFF))
            if plan.hsig != hsig:
                plan.hp = _hparams(group)
                plan.hsig = hsig
            plan.pt.data = target.data_ptr()
            gt = plan.gt
            gt.data = grad.data_ptr()
            gt.dtype = _DTYPES[grad.dtype]
            s0 = plan.st.step = int(state["step"])
            if scale == 1.0 or scale == 0.0:
                calls.append((p, plan, target, grad, plan.hp, None, state, scale, s0))
            else:
                hp, lr_before = _scaled_hparams(group, state, scale)
                calls.append((p, plan, target, grad, hp, lr_before, state, scale, s0))
                _scale_lrs(state, scale)  # (recorded first: the rollbacks find it)

    @staticmethod
    def _finish_ok(call) -> None:
        """After the update of a call of _prepare_calls succeeded: the lrs
        back to their unscaled values, the step, the parameter from its copy;
        the caller bumps p's autograd version and drops p.grad."""
        p, plan, target, _, _, lr_before, state, scale, _ = call
        # In this order, so that an interrupt anywhere leaves either the
        # step unrecorded and the stored lrs scaled (_settle then does all
        # of it again: the parameter's copy is copied again, the same
        # values), or the step recorded with the unscaled lrs kept in
        # plan.final_lrs until they are stored (_settle stores them again).
        lrs = _unscaled_lrs(state["lr"], lr_before, scale) if lr_before is not None else None
        if target is not p and scale != 0.0:
            p.copy_(target)
        plan.final_lrs = lrs
        state["step"] = plan.st.step
        if lrs is not None:
            state["lr"].copy_(lrs)
        plan.final_lrs = None

    def _finish_call(self, call, status: int) -> None:
        """After the update of a call of _prepare_calls returned status."""
        p, plan, _, _, _, lr_before, state, _, _ = call
        rep = plan.rep
        if status == _lib.OK:
            self._finish_ok(call)
            # The memory changed behind autograd's back: bump the version so
            # a backward that still needs the old value raises, as it would
            # after any in-place update.
            torch.autograd.graph.increment_version(p)
        else:
            if lr_before is not None:
                state["lr"].copy_(lr_before)
            if status < 0:
                raise AutomagicError("Automagic3: update of a parameter of shape %s failed: %s"
                                     % (tuple(p.shape), _lib.last_message()
                                        or _lib.status_string(status)))
            if self.nonfinite == "raise":
                raise NonFiniteGradientError(
                    "Automagic3: %s for a parameter of shape %s (%d non-finite gradient "
                    "elements); parameter and state are unchanged, p.grad kept"
                    % (_lib.status_string(status), tuple(p.shape), rep.nonfinite_count))
            self.nonfinite_skips += 1
            # Counted outside the state: SPEC 6.2 says a skipped update
            # leaves the parameter's state exactly as it was.
            index = self._param_index[p]
            self._skipped[index] = self._skipped.get(index, 0) + 1
            self._warn_once("nonfinite", "%s for a parameter of shape %s; its update was "
                            "skipped and it is unchanged (counted in nonfinite_skips; "
                            "warned once)" % (_lib.status_string(status), tuple(p.shape)),
                            RuntimeWarning)
        p.grad = None

    def _apply_jobs(self, jobs, cache_key) -> None:
        """The updates of jobs [(p, group, scale, hsig)], checked CPU
        parameters: one am_update_batch call for several (unless
        batch_updates is False), else one at a time."""
        if len(jobs) > 1 and self.batch_updates:
            self._apply_batch(jobs, cache_key)
        else:
            for job in jobs:
                self._apply(*job)

    def _apply_batch(self, jobs, cache_key) -> None:
        """The updates of jobs [(p, group, scale, hsig)], checked CPU
        parameters, in one am_update_batch call: whole parameters on separate
        threads (the same bits as _apply on each in turn; docs/PYTORCH.md).
        The item array and its workspace size are kept, under cache_key
        (step() and each of fused mode's batches of a step have their own),
        while the same plans and hyperparameters come in the same order
        (rebuilding them cost about 2 us per parameter)."""
        calls = []
        try:
            self._prepare_calls(jobs, calls)
            self._run_batch(jobs, calls, cache_key)
        except BaseException:
            self._settle(calls)
            raise

    def _settle(self, calls) -> None:
        """After an exception escaped the preparation or the update of calls
        (of _prepare_calls, each with the step its state recorded before it
        as its last item): KeyboardInterrupt
        (raised when the C call returns, before the finish), MemoryError, or
        an error the finish raised on purpose. C advances a plan's step
        exactly when it applied the update: such an update not yet recorded
        is recorded now (step, gradient dropped, lrs unscaled, the
        parameter from its copy); the lrs of one not applied go back from
        their schedule's scaling. Each call's finish did or does this once;
        found by a review (twenty-third session): an interrupt there left
        the parameter updated, its step not advanced and its gradient kept,
        and a retry applied the gradient again with the same noise."""
        applied = []
        for call in calls:
            p, plan, _, _, _, lr_before, state, _, s0 = call
            if plan.st.step == s0 + 1:  # applied (by this call or a retry of it)
                if int(state["step"]) == s0:
                    self._finish_ok(call)  # (its step recorded last: see there)
                elif plan.final_lrs is not None:  # recorded, its lrs maybe not
                    state["lr"].copy_(plan.final_lrs)
                    plan.final_lrs = None
                p.grad = None
                applied.append(p)
            elif lr_before is not None and int(state["step"]) == s0:
                state["lr"].copy_(lr_before)  # not applied: lrs back (again, maybe)
        if applied:
            # (a second bump of a finished one's version changes nothing)
            torch.autograd.graph.increment_version(applied)

    def _run_batch(self, jobs, calls, cache_key) -> None:
        """_apply_batch's C call and finish for its prepared calls."""
        n = len(calls)
        threads = torch.get_num_threads()
        plans = [c[1] for c in calls]
        hps = [c[4] for c in calls]
        cached = self._batch_cache.get(cache_key)
        if cached is not None and cached[0] == plans and cached[1] == hps:
            items, sizes = cached[2], cached[3]
        else:
            items = (_lib.BatchItem * n)()
            for it, call in zip(items, calls):
                _fill_batch_item(it, call[1], call[4])
            sizes = {}
            # (hps compare by identity: plan.hp objects are rebuilt when the
            # group's values change; scaled ones are new every step)
            self._batch_cache[cache_key] = (plans, hps, items, sizes)
        _lib.clear_message()
        nbytes = sizes.get(threads)
        status = _lib.OK
        if nbytes is None:
            nb = ctypes.c_size_t(0)
            status = _lib.lib.am_update_batch_workspace(items, n, threads, ctypes.byref(nb))
            nbytes = sizes[threads] = nb.value
        if status == _lib.OK:
            ws_ptr, ws_bytes = self._workspace(nbytes)
            status = _lib.lib.am_update_batch(items, n, ws_ptr, ws_bytes)
        if status != _lib.OK:
            # Nothing ran (e.g. two parameters share memory, which the batch
            # refuses): every parameter as it was; one at a time instead,
            # which updates them in turn or raises what it always raised.
            self._batch_cache.pop(cache_key, None)
            for call in calls:
                if call[5] is not None:  # lr_schedule="scale": lrs back
                    call[6]["lr"].copy_(call[5])
            for job in jobs:
                self._apply(*job)
            return
        statuses = torch.frombuffer(items, dtype=torch.int32).view(n, -1)[:, _STATUS_WORD]
        if not bool(statuses.any()):  # all AM_OK: the common case, in bulk
            for call in calls:
                self._finish_ok(call)
                call[0].grad = None
            # the memory changed behind autograd's back (_finish_call)
            torch.autograd.graph.increment_version([call[0] for call in calls])
            return
        error = None
        for st, call in zip(statuses.tolist(), calls):
            try:
                self._finish_call(call, st)
            except (AutomagicError, NonFiniteGradientError) as e:
                error = error or e  # the others are updated: finish them too
        if error is not None:
            raise error

    # ------------------------------------------------------ optimizer API
    @property
    def _step_supports_amp_scaling(self) -> bool:
        # Makes GradScaler.step() call our step(grad_scaler=...) in fused mode
        # so that we can say what is wrong instead of its "No inf checks".
        return self.fused

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        if grad_scaler is not None:
            raise AutomagicError(
                "Automagic3: GradScaler cannot be used with fused=True: fused mode has "
                "already applied the scaled gradients during backward, before the "
                "scaler could unscale them or check them for inf. Use fused=False")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.fused:
            self._steps.close()
            if self._micro != 0:
                # Mid-window. A caller whose step() calls so far all came at
                # window ends (a trainer with gradient accumulation: HF
                # Trainer, accelerate) calls it mid-window for the last,
                # shorter window of an epoch: that window ends here, as in
                # step mode (it was left open, and every later window
                # straddled two of the trainer's; found by a review,
                # twenty-third session). Otherwise (step() after every
                # backward pass, as the reference allows) the gradients keep
                # accumulating.
                if not self._aligned_steps:
                    self._aligned_steps = False
                    self._passes = 0
                    return loss
                self._warn_once("partial", "step() after %d of the %d backward passes of an "
                                "accumulation window: the window ends here, its gradients "
                                "applied (a trainer's last window of an epoch; warned once)"
                                % (self._micro, self.accumulation_steps))
                self._close_window(flush=True)
            elif self._aligned_steps is None and self._passes == self.accumulation_steps:
                # the evidence: a whole window between this step() and the
                # last, which came at a window's end too (a step() with no
                # backward pass before it, as torch.distributed.checkpoint's
                # initialisation makes, or one after a load, is none; taken
                # as such, each later step() ended its window: found by a
                # review, twenty-third session)
                self._aligned_steps = True
            self._passes = 0
        # Per group: its parameters with a gradient (in fused mode those
        # without a hook). Everything is checked before anything is updated,
        # so that a bad gradient or hyperparameter leaves every parameter as
        # it was. Loops per group, not per parameter with its group: this
        # runs for every parameter at every step.
        self._adopt_listed()
        if self._initialise_only():
            return loss
        todo, index_of, swapped = [], self._param_index, set()
        for group in self.param_groups:
            ps = [p for p in group["params"] if p.grad is not None]
            if self.fused:
                hooked = [p for p in ps if index_of.get(p) in self._hooked]
                if hooked:
                    swapped |= self._rehook_swapped(hooked)
                ps = [p for p in ps if index_of.get(p) not in self._hooked or id(p) in swapped]
            if ps:
                todo.append((group, ps))
        check, cpu_only = self._check, True
        for group, ps in todo:
            key = _group_key(group)
            if key is None or self._valid_groups.get(id(group)) != key:
                try:
                    _validate_group(group, check_lr=False)
                except (TypeError, ValueError) as e:
                    raise AutomagicError(str(e)) from None
                if key is not None:
                    self._valid_groups[id(group)] = key
            self._lr_scale(group)
            for p in ps:
                if not check(p, p.grad):
                    cpu_only = False
        if not (self.batch_updates and self.nonfinite != "raise" and cpu_only):
            # one update at a time below: each parameter's C view is checked
            # first, so that a refused one leaves every other as it was (the
            # earlier ones were updated before a later one was refused, under
            # a message saying nothing was; found by a review, twenty-second
            # session). One batch call prepares every view before it runs.
            for group, ps in todo:
                for p in ps:
                    # CUDA parameters too (they were refused only at their
                    # update, after earlier ones had been updated; found by
                    # a review, twenty-third session)
                    self._precheck_plan(p, group)
        if swapped:
            self._warn_once("swapped", "a parameter's tensor was swapped (torch.utils."
                            "swap_tensors: model.to()/half() under torch.__future__."
                            "set_swap_module_params_on_conversion(True), or load_state_dict("
                            "assign=True)) and its backward hook stopped firing; step() "
                            "updated it and its hook is registered again (warned once)")
        unhooked = ([p for _, ps in todo for p in ps if id(p) not in swapped]
                    if self.fused and todo else None)
        if unhooked:
            self._warn_once("nohook", "a parameter of shape %s has a gradient but "
                            "no backward hook (it did not require grad when it "
                            "was added, or it was put into param_groups by hand, not "
                            "with add_param_group); step() updates it"
                            % (tuple(unhooked[0].shape),))
        if not cpu_only and torch.cuda.is_current_stream_capturing():
            _cuda.refuse_capture(self, AutomagicError)  # before anything is queued
        _lib.lib.am_set_num_threads(torch.get_num_threads())
        # (nonfinite="raise" stops at the first skip: one at a time)
        batched = self.batch_updates and self.nonfinite != "raise"
        batch = []
        for group, ps in todo:
            scale, hsig = self._lr_scale(group), self._hsig(group)
            if batched and cpu_only:
                batch += [(p, group, scale, hsig) for p in ps]
                continue
            for p in ps:
                if p.is_cuda:
                    _cuda.update_param(self, p, group, AutomagicError)
                elif batched:
                    batch.append((p, group, scale, hsig))
                else:
                    self._apply(p, group, scale, hsig)
        self._apply_jobs(batch, "step")
        return loss

    def _initialise_only(self) -> bool:
        """torch.distributed.checkpoint's get/set_optimizer_state_dict (used
        by torchtitan, accelerate and Lightning) "initialise" an optimizer
        with no state by a step() with every group's lr set to 0 and zero
        gradients, so that its state_dict has the tensors a checkpoint
        loads into. An update there started every row at lr 0 (training
        then crawled up from min_lr; fused mode, where step() leaves hooked
        parameters alone, made no state, so a distributed checkpoint had
        nothing to load into; found by a review, twenty-third session).
        Such a step creates the state of every parameter with a gradient
        (step 0, rows at the group's start lr) and updates nothing; True
        then. The test is one float per group at every other step."""
        for group in self.param_groups:
            lr = group["lr"]
            if not ((isinstance(lr, torch.Tensor) and lr.numel() == 1 and float(lr) == 0.0)
                    or (is_real_number(lr) and lr == 0)):
                return False
        ps = [(p, g) for g in self.param_groups for p in g["params"] if p.grad is not None]
        # (no parameter with state at all: torch's own test before it steps)
        if (not ps or any(st for st in self.state.values())
                or any(p.grad.layout != torch.strided or bool(p.grad.any()) for p, _ in ps)):
            return False
        with self._steps.lock:
            for p, group in ps:
                self._init_state(p, group, float(group["base_lr"]))
        return True

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.fused:
            self._steps.close()
            if self._micro == 0 and self._rehook_swapped(
                    [p for g in self.param_groups for p in g["params"] if p.grad is not None]):
                self._warn_once("swapped_zero", "a parameter's tensor was swapped (torch.utils."
                                "swap_tensors: model.to()/half() under torch.__future__."
                                "set_swap_module_params_on_conversion(True), or "
                                "load_state_dict(assign=True)) and its backward hook stopped "
                                "firing: zero_grad() drops the gradient it was not updated "
                                "with; its hook is registered again, so the next backward "
                                "updates it (warned once)")
            if self._micro != 0:
                if any(p.grad is not None for g in self.param_groups for p in g["params"]):
                    self._warn_once("zero_grad", "zero_grad() in the middle of an "
                                    "accumulation window (accumulation_steps=%d, %d backward "
                                    "passes done) discards the gradients accumulated so far; "
                                    "the next backward pass starts a new window"
                                    % (self.accumulation_steps, self._micro))
                # the window's gradients are gone: a new one starts (it went
                # on counting, and every later window straddled two of the
                # caller's; found by a review, twenty-third session)
                self._close_window(flush=False)
        super().zero_grad(set_to_none=set_to_none)

    # ------------------------------------------------------- inspection
    def get_learning_rates(self) -> List[float]:
        out = []
        for group in self.param_groups:
            lrs = [float(self.state[p]["lr"].mean()) for p in group["params"]
                   if p in self.state and "lr" in self.state[p]]
            out.append(sum(lrs) / len(lrs) if lrs else float(group["lr"]))
        return out

    def get_avg_learning_rate(self) -> float:
        lrs = self.get_learning_rates()
        return sum(lrs) / len(lrs) if lrs else float(self.defaults["lr"])

    @staticmethod
    def _summary(lrs: List[torch.Tensor]) -> Optional[dict]:
        if not lrs:
            return None
        # on the CPU: a group may mix devices (torch.cat of cuda:0 and CPU
        # lrs raised; found by a review, twenty-third session)
        v = torch.cat([t.reshape(-1).to("cpu") for t in lrs])
        if v.numel() == 0:
            return None
        return dict(min=float(v.min()), median=float(v.median()), max=float(v.max()),
                    mean=float(v.double().mean()), rows=v.numel())

    def param_lr_stats(self, p: torch.Tensor) -> Optional[dict]:
        """min/median/max/mean of p's per-row lrs (None before its first
        update). The median is the lower one for an even count."""
        st = self.state.get(p)
        if not st or "lr" not in st:
            return None
        out = self._summary([st["lr"]])
        if out is not None:
            out.update(step=int(st["step"]),
                       skipped=self._skipped.get(self._param_index.get(p), 0))
        return out

    def lr_stats(self) -> List[Optional[dict]]:
        """Per group: min/median/max/mean over every row of every parameter
        with state, rows, and skipped (non-finite updates skipped). None for a
        group with no state yet. O(number of rows), no pass over weights."""
        out = []
        for group in self.param_groups:
            ps = [p for p in group["params"] if p in self.state and "lr" in self.state[p]]
            s = self._summary([self.state[p]["lr"] for p in ps])
            if s is not None:
                s["skipped"] = sum(self._skipped.get(self._param_index.get(p), 0) for p in ps)
            out.append(s)
        return out

    def remove_hooks(self) -> None:
        """Removes the backward hooks: fused mode stops, and the optimizer
        works in step mode from now on (step() updates every gradient)."""
        with self._steps.lock:
            self._steps.close()
            _remove_hooks(self._hook_handles)
            self._hooked = set()
            self.fused = False
            self.accumulation_steps = 1
            self._micro = 0  # (a stale position was saved in the state_dict)

    # ----------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        # The "automagic" entry is added by a state_dict post hook registered
        # first (_add_automagic_entry), so that the user's post hooks see it
        # (they ran before it was added: found by a review, twenty-third
        # session; a first fix swapped the hook dict out during the call,
        # and two threads' calls at once lost the hooks for good).
        sd = super().state_dict()
        if (isinstance(sd, dict) and "automagic" not in sd and _add_automagic_entry
                not in self._optimizer_state_dict_post_hooks.values()):
            _add_automagic_entry(self, sd)  # (the hook removed by hand)
        return sd

    def _automagic_entry(self) -> dict:
        return dict(format=_STATE_DICT_FORMAT, seed=self.seed,
                    nonfinite_skips=self.nonfinite_skips,
                    skipped_by_param=dict(self._skipped), micro_step=self._micro,
                    deferred=sorted(self._deferred), aligned_steps=self._aligned_steps)

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads our state_dict or one saved by the reference class.

        Everything is validated and converted before anything changes. State
        stays float32 (no cast to the parameter's dtype). The optimizer's own
        hyperparameters (constructor, add_param_group) win over saved ones,
        as in the reference; saved non-hyperparameter group keys (a
        scheduler's initial_lr) are restored, and so is group["lr"] when the
        saved group has an initial_lr (a scheduler owns it) or under
        lr_schedule="scale" (the lr is the schedule's)."""
        # torch's load_state_dict pre and post hooks, as torch.optim runs them
        # (a pre hook is torch's documented way to migrate an old dict; they
        # were not run)
        state_dict = state_dict.copy() if isinstance(state_dict, dict) else state_dict
        for hook in list(self._optimizer_load_state_dict_pre_hooks.values()):
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        self._load(state_dict)
        for hook in list(self._optimizer_load_state_dict_post_hooks.values()):
            hook(self)

    def _load(self, state_dict) -> None:
        """load_state_dict's work, between torch's hooks."""
        self._adopt_listed()  # (parameters put into a group by hand: their state too)
        new_state, new_groups = prepare_load(
            state_dict, self.param_groups, _HPARAM_KEYS,
            lambda p: _state_sizes(p).polarity_bytes,
            restore_lr=self.lr_schedule == "scale")
        extra = state_dict.get("automagic", {})
        # the bookkeeping values converted before the commit: a bad one
        # raised there, after the groups and the state had been replaced
        # (found by a review, twenty-second session)
        if not isinstance(extra, dict):
            raise CheckpointError("Automagic3: the state_dict's 'automagic' entry must be a "
                                  "dict, got %s" % type(extra).__name__)
        try:
            skips = int(extra.get("nonfinite_skips", 0))
            skipped = {int(k): int(v) for k, v in extra.get("skipped_by_param", {}).items()}
            micro = int(extra.get("micro_step", 0))
            deferred = set(int(i) for i in extra.get("deferred", ()))
            # whether the saved run's step() calls came at window ends (a
            # resumed trainer's first step() may close a shorter window; the
            # live value stays when the dict does not say: found by a review)
            aligned = extra.get("aligned_steps")
            if aligned is None:
                aligned = self._aligned_steps
            elif not isinstance(aligned, bool):
                raise TypeError("aligned_steps must be true, false or null, got %r"
                                % (aligned,))
        except (TypeError, ValueError, AttributeError) as e:
            raise CheckpointError("Automagic3: the state_dict's 'automagic' entry holds an "
                                  "invalid value (%s)" % e) from None
        nparams = len(self._param_index)  # indices are never reused
        if (skips < 0 or micro < 0 or any(v < 0 for v in skipped.values())
                or any(not 0 <= i < nparams for i in set(skipped) | deferred)):
            raise CheckpointError("Automagic3: the state_dict's 'automagic' entry holds a "
                                  "negative count or a parameter index out of range "
                                  "(nonfinite_skips %r, micro_step %r, skipped_by_param %r, "
                                  "deferred %r)" % (skips, micro, skipped, sorted(deferred)))
        seed = extra.get("seed", self.seed)
        if seed != self.seed:
            warnings.warn("Automagic3: the state_dict was saved with seed %r, this optimizer "
                          "has seed %r (kept: constructor arguments win); stochastic "
                          "rounding will differ from the saved run" % (seed, self.seed),
                          UserWarning, stacklevel=3)
        # ---- commit (nothing above changed the optimizer), undone whole if
        # an exception cuts it short: a KeyboardInterrupt there left some
        # parameters with the new state and the rest with none, silently
        # started again at the next step (found by a review, twenty-third
        # session). (The tensors' hash is Python code: Python may raise a
        # pending signal at any key of these loops.)
        old_groups = [dict(g) for g in self.param_groups]
        old_state = dict(self.state)
        old_book = (self.nonfinite_skips, self._skipped, self._micro, self._deferred,
                    self._updated, self._window_fired, self._aligned_steps, self._passes)
        with self._steps.lock:
            self._steps.close()
            try:
                for g, ng in zip(self.param_groups, new_groups):
                    g.clear()
                    g.update(ng)
                self.state.clear()
                for p, st in new_state.items():
                    self.state[p] = st
                self.nonfinite_skips = skips
                self._skipped = skipped
                self._micro = micro % self.accumulation_steps
                self._deferred = deferred
                self._updated = set()
                self._window_fired = set() if self._micro == 0 else None
                # (the passes since the last step() are not known: counted
                # from here, so that a later step() is evidence only after a
                # whole window between two step() calls of this run)
                self._aligned_steps, self._passes = aligned, 0
            except BaseException:
                for g, og in zip(self.param_groups, old_groups):
                    g.clear()
                    g.update(og)
                self.state.clear()
                self.state.update(old_state)
                (self.nonfinite_skips, self._skipped, self._micro, self._deferred,
                 self._updated, self._window_fired, self._aligned_steps,
                 self._passes) = old_book
                raise

    # ---------------------------------------------- pickle and deepcopy
    def __getstate__(self) -> dict:
        # Hook handles, the thread-local workspace and locks cannot be
        # pickled; they are rebuilt by __setstate__ (hooks re-registered on
        # the unpickled parameters).
        return dict(defaults=self.defaults, state=self.state, param_groups=self.param_groups,
                    seed=self.seed, fused=self.fused,
                    accumulation_steps=self.accumulation_steps, nonfinite=self.nonfinite,
                    lr_schedule=self.lr_schedule, nonfinite_skips=self.nonfinite_skips,
                    batch_updates=self.batch_updates, fused_batch_bytes=self.fused_batch_bytes,
                    micro=self._micro, deferred=set(self._deferred),
                    warned=set(self._warned), skipped=dict(self._skipped),
                    aligned=self._aligned_steps)

    def __setstate__(self, d: dict) -> None:
        extra = {k: d.pop(k) for k in ("micro", "deferred", "warned", "skipped")}
        aligned = d.pop("aligned", None)  # (pickled before it was kept: not known)
        d.setdefault("batch_updates", True)  # pickled before these were kept
        d["_fused_batch_bytes"] = d.pop("fused_batch_bytes", 4 << 20)
        super().__setstate__(d)
        self.register_state_dict_post_hook(_add_automagic_entry, prepend=True)
        self._init_runtime()
        self._micro, self._deferred = extra["micro"], extra["deferred"]
        self._warned, self._skipped = extra["warned"], extra["skipped"]
        self._window_fired = set() if self._micro == 0 else None
        self._aligned_steps, self._passes = aligned, 0  # (as load_state_dict)
        for group in self.param_groups:
            self._register_params(group)
