"""Conversion and validation of optimizer state for load_state_dict.

Two formats are accepted for one parameter's state:
  ours       : step, lr (float32), polarity (uint8, packed bits as in
               include/automagic.h), exp_avg_sq_row/_col or exp_avg_sq
               (float32).
  reference  : the original Automagic3 class: step, lr, last_polarity (bool,
               shape of p), exp_avg_sq_row/_col or exp_avg_sq in p.dtype.
Either is turned into ours, on the parameter's device, without touching the
optimizer: the caller commits only when every parameter converted.
"""
import math
import numbers

import torch


def is_real_number(v) -> bool:
    """A real number as a hyperparameter: int, float, numpy's scalars and
    other numbers.Real (the reference and torch.optim take numpy float32
    values, which are not floats: they were refused, found by a review,
    twenty-third session); never a bool."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


class CheckpointError(ValueError):
    """A state_dict does not fit the parameters it is loaded for."""


def as_count(value) -> int:
    """A saved count, step or parameter index -> int: an int (numpy's too),
    a float or a one-element tensor holding a whole number. ValueError for
    anything else (a bool, a fraction, inf or NaN, a string, a tensor of
    several elements): such values were truncated (1.7 skips read as 1), read
    character by character ("01" as the indices {0, 1}) or raised
    OverflowError/RuntimeError instead of CheckpointError (found by a
    review, thirty-third session)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype == torch.bool or value.is_complex():
            raise ValueError("%r is not one integer" % (value,))
        value = value.item()
    elif getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        value = value.item()  # numpy's scalars and 0-d arrays
    if isinstance(value, bool):
        raise ValueError("%r is not an integer" % (value,))
    if isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise ValueError("%r is not a whole number" % (value,))
        return int(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    raise ValueError("%r is not an integer" % (value,))


def as_key(value) -> int:
    """A parameter index as a mapping's key: as_count, or a string of
    decimal digits (a JSON or YAML round trip makes int keys strings)."""
    if isinstance(value, str) and value.isascii() and value.isdigit():
        return int(value)
    return as_count(value)


def as_indices(value) -> set:
    """A saved collection of parameter indices -> a set of ints (ValueError
    for a string or a mapping, read element by element before)."""
    if isinstance(value, (str, bytes, dict)):
        raise ValueError("%r is not a list of parameter indices" % (value,))
    return set(as_count(i) for i in value)


def _finite(v) -> bool:
    """v >= 0 and finite, for any real number (an int beyond float's range
    raised OverflowError in math.isfinite)."""
    try:
        return math.isfinite(float(v)) and v >= 0
    except (OverflowError, TypeError, ValueError):
        return False


def _lr_rows(shape) -> tuple:
    """(lr-rows, elements of each) of a parameter of this shape: dims[0]
    rows for ndim >= 2, one row otherwise (the C polarity layout)."""
    shape = torch.Size(shape)
    rows = shape[0] if len(shape) >= 2 else 1
    return rows, (shape.numel() // rows if rows else 0)


# Elements packed at a time: the bools of a reference checkpoint's
# last_polarity are converted in pieces of this many, so that packing a
# parameter of 2e9 elements takes a few MB beside its input and result
# (widened to int32 at once, as until the thirty-fifth session, it took
# about 15 bytes an element: 31 GB for a 128256 x 16384 embedding).
_PACK_CHUNK = 1 << 22


def pack_polarity(bits: torch.Tensor) -> torch.Tensor:
    """bool tensor of p's shape -> uint8 bytes in the C polarity layout.

    ndim <= 1: bit i % 8 of byte i // 8 is element i. ndim >= 2: each lr-row
    (the numel/shape[0] elements of one output channel) starts on a byte.
    """
    rows, m = _lr_rows(bits.shape)
    mb = (m + 7) // 8
    out = torch.empty(rows, mb, dtype=torch.uint8, device=bits.device)
    if rows == 0 or m == 0:
        return out.reshape(-1)
    flat = bits.reshape(rows, m)
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    # whole lr-rows at a time, or pieces of one (a multiple of 8 elements)
    nr = max(1, _PACK_CHUNK // m)
    width = m if m <= _PACK_CHUNK else max(8, _PACK_CHUNK // 8 * 8)
    for r0 in range(0, rows, nr):
        r1 = min(rows, r0 + nr)
        for c0 in range(0, m, width):
            c1 = min(m, c0 + width)
            part = flat[r0:r1, c0:c1].to(torch.uint8)
            if (c1 - c0) % 8:
                part = torch.nn.functional.pad(part, (0, 8 - (c1 - c0) % 8))
            # the eight bits of a byte are disjoint: their uint8 sum is exact
            out[r0:r1, c0 // 8:(c1 + 7) // 8] = (
                part.reshape(r1 - r0, -1, 8) << shifts).sum(-1, dtype=torch.uint8)
    return out.reshape(-1)


def unpack_polarity(packed: torch.Tensor, shape) -> torch.Tensor:
    """Inverse of pack_polarity (used by tests and for inspection)."""
    shape = torch.Size(shape)
    rows, m = _lr_rows(shape)
    mb = (m + 7) // 8
    bytes_ = packed.reshape(rows, mb, 1)
    bits = (bytes_ >> torch.arange(8, dtype=torch.uint8, device=packed.device)) & 1
    return bits.reshape(rows, mb * 8)[:, :m].reshape(shape).to(torch.bool)


def expected_shapes(p: torch.Tensor, polarity_bytes: int) -> dict:
    lr_shape = (p.shape[0],) if p.dim() >= 2 else tuple(p.shape)
    out = {"lr": lr_shape, "polarity": (polarity_bytes,)}
    if p.dim() >= 2:
        out["exp_avg_sq_row"] = tuple(p.shape[:-1])
        out["exp_avg_sq_col"] = tuple(p.shape[:-2] + p.shape[-1:])
    else:
        out["exp_avg_sq"] = tuple(p.shape)
    return out


_STEP_MAX = (1 << 63) - 1


def _step(value, where) -> int:
    try:
        n = as_count(value)
    except ValueError:
        n = -1
    if n < 0:
        raise CheckpointError("%s: step must be an integer >= 0, got %r" % (where, value))
    value = n
    if value > _STEP_MAX:
        # (the C state's step is an int64: a larger one wrapped, silently to
        # another step's noise, or failed at the next update; found by a
        # review, thirtieth session)
        raise CheckpointError("%s: step %r is beyond the largest step, 2^63 - 1"
                              % (where, value))
    return value


def convert_state(saved: dict, p: torch.Tensor, polarity_bytes: int, where: str) -> dict:
    """One parameter's saved state -> a new dict in our format (copies)."""
    if not isinstance(saved, dict):
        raise CheckpointError("%s: state must be a dict, got %s" % (where, type(saved).__name__))
    shapes = expected_shapes(p, polarity_bytes)
    saved = dict(saved)
    if "last_polarity" in saved:  # the reference class's format
        if "polarity" in saved:
            raise CheckpointError("%s: both 'polarity' (ours) and 'last_polarity' (the "
                                  "reference's) are present; a state holds one" % where)
        lp = saved.pop("last_polarity")
        if not isinstance(lp, torch.Tensor) or lp.shape != p.shape or lp.is_complex():
            raise CheckpointError("%s: last_polarity must be a bool tensor of shape %s"
                                  % (where, tuple(p.shape)))
        if lp.dtype != torch.bool:
            # torch's Optimizer.load_state_dict casts every floating state
            # tensor to the parameter's dtype: a reference that resumed from
            # a checkpoint saves last_polarity as 0.0/1.0 until the
            # parameter's next update; the values, not the dtype, must be bits
            # (a piece at a time: three bool temporaries of p's size before;
            # pack_polarity takes the 0.0/1.0 values as they are)
            for c in lp.reshape(-1).split(_PACK_CHUNK):
                if not bool(((c == 0) | (c == 1)).all()):
                    raise CheckpointError("%s: last_polarity (%s) holds values other than 0 "
                                          "and 1" % (where, lp.dtype))
        # packed where the dict lies, then moved (an eighth of the bools)
        saved["polarity"] = pack_polarity(lp).to(p.device)
    out = {"step": _step(saved.get("step"), where)}
    for key, shape in shapes.items():
        t = saved.get(key)
        if not isinstance(t, torch.Tensor):
            raise CheckpointError("%s: missing tensor %r" % (where, key))
        if tuple(t.shape) != shape:
            raise CheckpointError("%s: %s has shape %s, expected %s"
                                  % (where, key, tuple(t.shape), shape))
        if key == "polarity":
            if t.dtype != torch.uint8:
                raise CheckpointError("%s: polarity must be uint8, got %s" % (where, t.dtype))
            # (detached: a tensor that requires grad was kept with its
            # autograd history, and deepcopy of the optimizer then failed)
            out[key] = t.detach().to(device=p.device, copy=True).contiguous()
            # as the C loader (checkpoint.c): each lr-row's padding bits are 0
            rows, m = _lr_rows(p.shape)
            if m % 8 and rows and bool((out[key].reshape(rows, -1)[:, -1]
                                         & (0xFF << (m % 8)) & 0xFF).any()):
                raise CheckpointError("%s: polarity has padding bits set (not a packed "
                                      "state of this shape)" % where)
        else:
            if not t.is_floating_point():
                raise CheckpointError("%s: %s must be floating point, got %s"
                                      % (where, key, t.dtype))
            if t.dtype == torch.float64:
                raise CheckpointError("%s: %s is float64; the state is float32" % (where, key))
            # Widening bf16/fp16 to float32 is exact; float32 is copied as is.
            out[key] = t.detach().to(device=p.device, dtype=torch.float32,
                                      copy=True).contiguous()
    # As the C checkpoint loader: lrs are clamped to [min_lr >= 0, max_lr],
    # and second moments are averages of squares, so only a negative value
    # is impossible. An lr of 0 is reached with min_lr=0 (the per-row lr
    # decays to it), +inf/NaN with max_lr or lr_bump_rate beyond float range;
    # a state the optimizer holds must load again. (A negative moment was
    # loaded, and a 1-D parameter's next update wrote NaN into it; found by a
    # review, thirtieth session.)
    for key in shapes:
        if key != "polarity" and any(bool((c < 0).any())
                                     for c in out[key].reshape(-1).split(_PACK_CHUNK)):
            raise CheckpointError("%s: %s holds a negative value" % (where, key))
    unknown = set(saved) - set(shapes) - {"step"}
    if unknown:
        raise CheckpointError("%s: unknown state keys %s" % (where, sorted(unknown)))
    return out


def prepare_load(state_dict, groups, hparam_keys, polarity_bytes_of, restore_lr=False):
    """Validates a whole optimizer state_dict against the optimizer's groups
    and returns (new state by parameter, new group dicts) without changing
    anything. Parameters are matched by position, as torch does.

    Group keys in hparam_keys (and "lr") keep the optimizer's values (its
    constructor wins); other saved keys (a scheduler's initial_lr) are
    restored, and "lr" too when the saved group has an initial_lr or, with
    restore_lr, a base_lr (lr_schedule="scale": group["lr"] is the
    schedule's state, which ReduceLROnPlateau or a hand-written decay keep
    without an initial_lr: a resumed run started again at the first lr,
    found by a review, twenty-third session)."""
    if not isinstance(state_dict, dict) or "state" not in state_dict \
            or "param_groups" not in state_dict:
        raise CheckpointError("Automagic3: not an optimizer state_dict (needs 'state' "
                              "and 'param_groups')")
    saved_groups = state_dict["param_groups"]
    if not isinstance(state_dict["state"], dict) or not isinstance(saved_groups, (list, tuple)) \
            or not all(isinstance(sg, dict) and isinstance(sg.get("params"), (list, tuple))
                       for sg in saved_groups):
        raise CheckpointError("Automagic3: not an optimizer state_dict ('state' must be a "
                              "dict, 'param_groups' a list of dicts with a 'params' list)")
    if len(saved_groups) != len(groups):
        raise CheckpointError("Automagic3: state_dict has %d parameter groups, the "
                              "optimizer %d" % (len(saved_groups), len(groups)))
    id_map = {}
    for gi, (sg, g) in enumerate(zip(saved_groups, groups)):
        if len(sg["params"]) != len(g["params"]):
            raise CheckpointError("Automagic3: group %d has %d parameters in the "
                                  "state_dict, %d in the optimizer"
                                  % (gi, len(sg["params"]), len(g["params"])))
        for pid, p in zip(sg["params"], g["params"]):
            id_map[pid] = p
    new_state = {}
    for pid, saved in state_dict["state"].items():
        if pid not in id_map:
            raise CheckpointError("Automagic3: state for unknown parameter id %r" % (pid,))
        p = id_map[pid]
        if isinstance(saved, dict) and not saved:
            # an empty entry: opt.state is a defaultdict, so looking at
            # opt.state[p] before p's first update leaves {} to be saved;
            # p has no state (the reference loads it the same way)
            continue
        where = "Automagic3: state of parameter %r (shape %s)" % (pid, tuple(p.shape))
        try:
            new_state[p] = convert_state(saved, p, polarity_bytes_of(p), where)
        except CheckpointError:
            raise
        except (RuntimeError, TypeError, ValueError, AttributeError, NotImplementedError,
                OverflowError) as e:
            # a tensor torch cannot convert (sparse, on the meta device, ...)
            raise CheckpointError("%s: cannot be loaded: %s: %s"
                                  % (where, type(e).__name__, e)) from None
    new_groups = []
    for sg, g in zip(saved_groups, groups):
        ng = dict(g)
        for k, v in sg.items():
            if k != "params" and k not in hparam_keys and k != "lr":
                # (a tensor copied, as torch.optim's load copies the groups)
                ng[k] = v.detach().clone() if isinstance(v, torch.Tensor) else v
        # Under restore_lr only a group saved with its start lr (base_lr:
        # ours) holds a schedule's lr: the reference's (and any optimizer's
        # without one) "lr" is its start lr, the factor 1, and the saved
        # value put in as a factor of another start lr scaled every rate
        # (a reference checkpoint saved at lr 1e-4 halved the rates of an
        # optimizer built with 2e-4; found by a review, thirtieth session).
        if "initial_lr" in sg or (restore_lr and "lr" in sg and "base_lr" in sg):
            # a scheduler's lr, restored: a number >= 0 (a NaN or negative one
            # was restored and made every later update of a new row fail)
            lr = sg["lr"]
            v = (float(lr) if isinstance(lr, torch.Tensor) and lr.numel() == 1
                 and lr.is_floating_point() else lr)
            if not is_real_number(v) or not _finite(v):
                raise CheckpointError("Automagic3: group %d's saved lr %r (restored: a "
                                      "schedule's) must be a finite number >= 0"
                                      % (len(new_groups), lr))
            ratio = 1.0
            if "initial_lr" not in sg:
                # restored as the schedule's factor of the start lr: the
                # start lr is the constructor's (it wins), and the saved lr
                # put into a group with another start lr changed that factor
                # (found by a review, twenty-third session)
                sb, nb = sg.get("base_lr"), g.get("base_lr")
                if (is_real_number(sb) and is_real_number(nb) and sb > 0
                        and _finite(sb) and _finite(nb) and nb != sb):
                    ratio = float(nb) / float(sb)
            if isinstance(lr, torch.Tensor):
                # a copy, as torch.optim's load makes: the saved dict's tensor
                # was shared with the group (a schedule's in-place change of
                # one changed the other)
                lr = lr.detach().clone()
                if ratio != 1.0:
                    lr.mul_(ratio)
            elif ratio != 1.0:
                lr = float(lr) * ratio
            ng["lr"] = lr
        new_groups.append(ng)
    return new_state, new_groups
