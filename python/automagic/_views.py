"""The C views (ctypes structures) of a parameter, its gradient and its
state, and the checks that make them safe to hand to libautomagic; the
hyperparameters of a group as the C library takes them."""
import ctypes

import torch

from . import _cuda, _lib
from ._checkpoint import expected_shapes, is_real_number
from ._errors import AutomagicError

_DTYPES = {torch.float32: _lib.DTYPE_FLOAT32, torch.bfloat16: _lib.DTYPE_BFLOAT16,
           torch.float16: _lib.DTYPE_FLOAT16}

# Device types _update_param can hand to libautomagic ("cuda": issue 7, when
# libautomagic_cuda.so is installed; see _cuda.py).
_SUPPORTED_DEVICE_TYPES = ("cpu", "cuda") if _cuda.library_present() else ("cpu",)
_STRIDED = torch.strided

# hp.lr is validated by C but not used by an update (the per-row lrs live in
# the state), so every call passes this valid constant.
_PLACEHOLDER_LR = 1e-6


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
    _refuse_short_storage(p, "a parameter of shape %s" % (tuple(p.shape),))
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
        _refuse_short_storage(t, "the state %r of a parameter of shape %s"
                              % (key, tuple(p.shape)))


def _refuse_short_storage(t: torch.Tensor, what: str) -> None:
    """Raises AutomagicError when t's elements run past the end of its
    storage: a storage resized under the tensor (untyped_storage().resize_),
    which torch does not check until the tensor is read. The C update wrote
    the whole tensor into it (heap corruption; found in the twenty-fourth
    session). Checked whenever a C view is (re)built: resizing moves the
    memory, so the view's signature changes."""
    if t.numel() == 0:
        return
    end = t.storage_offset() + 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    have = t.untyped_storage().nbytes()
    if end * t.element_size() > have:
        raise AutomagicError(
            "Automagic3: %s needs %d bytes of storage but its storage holds %d (resized "
            "under it?); nothing was updated" % (what, end * t.element_size(), have))


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


def _plan_signature(p: torch.Tensor, state: dict, seed: int, ptr=None) -> tuple:
    """Everything a _Plan's structures hold: the parameter's storage, dtype and
    shape, the state tensors' storage (by address: share_memory_(), .data =
    or set_() move it without changing the tensor object), and the seed. ptr:
    p.data_ptr() when the caller has it."""
    # written out, not a loop over the keys: this runs for every parameter
    # at every step (1.2 -> 0.7 us)
    if ptr is None:
        ptr = p.data_ptr()
    try:
        if p.dim() >= 2:
            return (ptr, p.dtype, p.shape, seed, state["lr"].data_ptr(),
                    state["polarity"].data_ptr(), state["exp_avg_sq_row"].data_ptr(),
                    state["exp_avg_sq_col"].data_ptr())
        return (ptr, p.dtype, p.shape, seed, state["lr"].data_ptr(),
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
                 "held", "final_lrs", "gdt", "made")

    def __init__(self, p: torch.Tensor, state: dict, sig: tuple, key) -> None:
        self.sig = sig
        self.pt = _lib.Tensor(0, _DTYPES[p.dtype], _shape(p))
        self.gt = _lib.Tensor(0, _DTYPES[p.dtype], _shape(p))
        self.gdt = p.dtype  # the torch dtype gt.dtype holds (the gradient's)
        self.made = False  # the update being prepared made the state
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
    for c in state["lr"].view(-1).split(_LR_PIECE):  # (float64 pieces, not the whole)
        c.copy_(c.double() * scale)


# float32's smallest normal value: a rate times a schedule's factor below it
# is subnormal (fewer bits) and can round to 0 (see _unscaled_lrs)
_FLT_MIN = 2.0 ** -126

# The lrs are rescaled in float64 pieces of this many: a 1-D parameter has
# one lr an element, and float64 temporaries of the whole took 21 bytes an
# element at its step (8.6 in pieces; a review, thirty-fifth session).
_LR_PIECE = 1 << 20


def _unscaled_lrs(lr: torch.Tensor, lr_before: torch.Tensor, scale: float) -> torch.Tensor:
    """The stored lrs after an update under lr_schedule="scale" that ran
    with lr_before * scale (_scaled_hparams): lr / scale, in float64 (scale
    may be tiny); rows whose scaled rate was below float32's normal range
    keep lr_before (no bump that step: their scaled rate, and so the bump
    read back from it, had lost precision or was 0, and dividing it back
    gave a wrong rate, 0, or NaN; what such a row applied, under 2^-126, moves
    no parameter larger than about 1e-30). A row at lr 0 is not kept: its
    scaled rate, 0, is exact, and the bump clamps it to the scaled min_lr,
    which divides back to min_lr (kept, it stayed at 0 for ever once the
    factor was not 1, where lr_schedule="ignore" takes it to min_lr at its
    next bump; found by a review, thirtieth session)."""
    out = torch.empty_like(lr)
    for o, a, b in zip(out.view(-1).split(_LR_PIECE), lr.view(-1).split(_LR_PIECE),
                       lr_before.view(-1).split(_LR_PIECE)):
        kept = (b.double() * scale < _FLT_MIN) & (b != 0)
        torch.where(kept, b, (a.double() / scale).float(), out=o)
    return out


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


def _refuse_subclass(p: torch.Tensor, where: str, error) -> None:
    """Refuses a tensor whose memory is not its own elements: a DTensor
    (FSDP2's fully_shard, tensor parallelism) or another wrapper subclass,
    which has no data pointer (the C update said "param data is NULL")."""
    if p.numel() == 0 or p.data_ptr() != 0:
        return
    if "DTensor" in [c.__name__ for c in type(p).__mro__]:
        raise error("%s is a DTensor (FSDP2's fully_shard or tensor parallelism): sharded "
                    "parameters are not supported; use DistributedDataParallel, or "
                    "ZeroRedundancyOptimizer to shard the optimizer, with fused=False "
                    "(docs/PYTORCH.md)" % where)
    raise error("%s is a %s whose elements have no memory address of their own (a tensor "
                "subclass); only plain tensors can be updated" % (where, type(p).__name__))


def _check_param(p, index: int) -> None:
    """Refuses, at construction, a parameter no update could handle."""
    if isinstance(p, torch.nn.parameter.UninitializedTensorMixin):
        # (its shape cannot be read: torch's own error pointed at
        # load_state_dict; found by a review, twenty-fifth session)
        raise ValueError("Automagic3: parameter %d is uninitialized (a lazy module such as "
                         "nn.LazyLinear): run one forward pass through the model before "
                         "creating the optimizer" % index)
    if not isinstance(p, torch.Tensor):
        # (no shape: "(shape ())" was said of anything; a module is named
        # as such: found by a review, thirty-second session)
        hint = (": pass model.parameters(), not the module"
                if isinstance(p, torch.nn.Module) else "")
        raise TypeError("Automagic3: parameter %d is a %s, not a torch.Tensor%s"
                        % (index, type(p).__name__, hint))
    where = "Automagic3: parameter %d (shape %s)" % (index, tuple(p.shape))
    if p.device.type not in _SUPPORTED_DEVICE_TYPES:
        raise ValueError("%s is on device '%s'; this build updates %s tensors only"
                         % (where, p.device, "/".join(_SUPPORTED_DEVICE_TYPES)))
    # (a frozen one of another dtype, a quantized or float64 base model's
    # weight in model.parameters(), is kept and left alone, as the reference
    # does: it is checked if it ever gets a gradient; refused until the
    # thirty-seventh session, a review)
    if p.dtype not in _DTYPES and p.requires_grad:
        raise TypeError("%s has dtype %s; supported: float32, bfloat16, float16%s (a "
                        "parameter that does not require grad may have any dtype)"
                        % (where, p.dtype, " (float64 would be rounded to float32 every step)"
                           if p.dtype == torch.float64 else ""))
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
