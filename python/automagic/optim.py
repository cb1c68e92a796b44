"""automagic.Automagic3: the PyTorch front end of libautomagic.

A drop-in for the reference ``Automagic3`` class (same constructor names and
defaults, same state keys where the meaning is the same). Each update runs in
C on the tensors' memory; state lives in ``opt.state[p]`` as torch tensors.
docs/PYTORCH.md describes the options, fused mode and checkpoints.
"""
import math
import threading
import warnings
import weakref
from typing import List, Optional

import torch

from . import _cuda, _lib, _threads
from ._checkpoint import is_real_number
from ._errors import AutomagicError, NonFiniteGradientError, caller_level
from ._fused import BackwardSteps
from ._hooks import _FusedMixin
from ._state_dict import _StateDictMixin, _add_automagic_entry
from ._update import _UpdateMixin
from ._views import _check_param, _group_key, _state_sizes, _validate_group

__all__ = ["Automagic3", "AutomagicError", "NonFiniteGradientError"]

_threads.use_torch_threads()


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


class Automagic3(_UpdateMixin, _FusedMixin, _StateDictMixin, torch.optim.Optimizer):
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
        self._fused = bool(fused)
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
    def fused(self) -> bool:
        """Fused mode (updates inside backward). Setting it to False is
        remove_hooks(); setting it back to True is refused: create the
        optimizer with fused=True (an assignment was ignored, the hooks went
        on updating in backward; found by a review, thirty-fourth
        session)."""
        return self._fused

    @fused.setter
    def fused(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError("Automagic3: fused must be True or False, got %r" % (value,))
        if value == self._fused:
            return
        if value:
            raise ValueError("Automagic3: fused mode is chosen at construction "
                             "(Automagic3(..., fused=True) registers the backward hooks); "
                             "it cannot be switched on later")
        self.remove_hooks()

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
        self._other_checked = False    # _check_other_optimizers has run
        # step() came in mid-window (fused mode, not at window ends) and no
        # backward pass, window end or load since: zero_grad() applies the
        # window (not kept by state_dict or pickle: after a load, a
        # zero_grad() discards, as before the thirty-second session)
        self._stepped_mid = False
        # zero_grad() ended such a window and has yet to update the
        # parameters without a hook (kept across an interrupt there: the
        # retried zero_grad() does it; cleared by _update_grads, by a
        # refusal there, by the next backward pass and by a load)
        self._unhooked_pending = False
        # the indices whose update a window's flush had not made when an
        # interrupt cut it short (_close_window; None: none)
        self._flush_left = None
        self._left_by_zero_grad = False  # (set by zero_grad()'s window end: see there)
        # with it, the window's gradients as that step() left them: index ->
        # (weak reference, version) (_snap_window)
        self._mid_grads = {}
        # and whether a forward pass has run since (_watch_forward; its
        # global hook's handle while it waits for one)
        self._fwd_since_step, self._fwd_hook = False, None
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
        # the step (BackwardSteps.gen) whose close last counted its pass, and
        # whether that pass's end is still to finish (_on_step_closed)
        self._counted, self._ending = self._steps.gen, False
        self._micro = 0                # backward passes done in this window
        # fused mode: whether every step() so far came at a window's end
        # (None: not known yet; see step()), and the backward passes since
        # the last step()
        self._aligned_steps = None
        self._passes = 0
        # indices whose hook fired since the last step(), and whether one
        # fired in two passes of them
        self._since_step, self._refired = set(), False
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
        # id(group) -> its (min_lr, max_lr) when added: an lr scheduler that
        # writes those keys (OneCycleLR) is warned about (_hsig)
        self._clamps_added = {}
        self._batch_cache = {}         # _apply_batch's items, by caller's key
        self._queue = []               # fused mode: small updates not yet run
        self._queue_bytes = 0          # their gradients' bytes
        self._batches = 0              # queues run in this step

    def _warn_once(self, key: str, msg: str, category=UserWarning) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn("Automagic3: " + msg, category, stacklevel=caller_level())

    # ----------------------------------------------------------- groups
    def add_param_group(self, param_group: dict) -> None:
        # Everything is checked before the group is added, so a refused
        # group leaves the optimizer as it was.
        if not isinstance(param_group, dict):
            raise TypeError("Automagic3: a parameter group must be a dict, got %s"
                            % type(param_group).__name__)
        # (checked and completed on a copy; the caller's own dict is what
        # param_groups holds once it is added, as torch.optim's: a copy kept
        # later changes made through the caller's dict from taking effect,
        # found by a review, thirty-seventh session)
        given, param_group = param_group, dict(param_group)
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
        given.update(self.param_groups[-1])
        group = self.param_groups[-1] = given
        # (set, not kept: a dict an earlier optimizer was built from holds
        # that one's start lr, and its lr may have changed since; a review)
        group["base_lr"] = float(group["lr"])
        self._clamps_added[id(group)] = (float(group["min_lr"]), float(group["max_lr"]))
        self._register_params(group)

    def _fill_group(self, group: dict) -> None:
        """What add_param_group gives a group, for a group dict a script put
        into param_groups itself (param_groups[i] = {...}, which torch.optim
        and docs/PYTORCH.md allow, or .append({...})): the constructor's
        values of the hyperparameters it lacks, and its start lr (base_lr,
        where its parameters' rows start under lr_schedule="scale") from its
        lr. Such a group failed with a bare KeyError: 'base_lr', in fused
        mode inside backward (found by a review, thirtieth session). Its
        values are validated where every group's are. The start lr is the
        group's initial_lr when an lr scheduler is attached (it records the
        lr the group had, as add_param_group did; a warm-up from 0, or
        torch.distributed.checkpoint's initialisation step, which sets every
        lr to 0 for one step(), leave group["lr"] at 0), else its lr, which
        must then be > 0 and finite, as add_param_group requires (a start
        lr of 0 divided every later factor of lr_schedule="scale" by 0)."""
        for k, v in self.defaults.items():
            group.setdefault(k, v)
        key = "initial_lr" if "initial_lr" in group else "lr"
        lr = group[key]
        if isinstance(lr, torch.Tensor) and lr.numel() == 1 and lr.is_floating_point():
            lr = float(lr)
        if not is_real_number(lr) or not (math.isfinite(lr) and lr > 0):
            raise AutomagicError(
                "Automagic3: a parameter group put into param_groups by hand (not with "
                "add_param_group) takes its group['%s'] as its start lr, which must be a "
                "finite number > 0 (or a one-element floating tensor), got %r; add the "
                "group with add_param_group to start it from its lr" % (key, group[key]))
        group["base_lr"] = float(lr)
        if is_real_number(group["min_lr"]) and is_real_number(group["max_lr"]):
            self._clamps_added[id(group)] = (float(group["min_lr"]), float(group["max_lr"]))

    def _fill_groups(self, strict: bool = True) -> None:
        """_fill_group of every group put into param_groups by hand; not
        strict: one that cannot be completed is left as it is (state_dict()
        saves it as it is)."""
        for group in self.param_groups:
            if "base_lr" not in group:
                try:
                    self._fill_group(group)
                except AutomagicError:
                    if strict:
                        raise

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
        seen = set()
        for group in self.param_groups:
            for p in group["params"]:
                if id(p) in seen:
                    self._warn_listed_twice(p)
                seen.add(id(p))
                if p not in self._param_index:
                    try:
                        _check_param(p, len(self._param_index))
                    except (TypeError, ValueError) as e:
                        raise AutomagicError(str(e) + " (put into param_groups by hand; "
                                             "add_param_group checks it)") from None
                    self._param_index[p] = len(self._param_index)
        self._listed = listed

    def _adopt_listed_quietly(self) -> None:
        """_adopt_listed where nothing must raise (zero_grad(), state_dict()):
        a refused parameter stays unregistered, and step() raises it."""
        try:
            self._adopt_listed()
        except AutomagicError:
            pass

    def _warn_listed_twice(self, p: torch.Tensor) -> None:
        self._warn_once("listed_twice", "a parameter of shape %s is listed more than once in "
                        "param_groups (put in by hand): it is updated once, in step mode "
                        "with the hyperparameters of the first group that lists it, in fused "
                        "mode with those of the group its backward hook was registered with; "
                        "list each parameter once (warned once)" % (tuple(p.shape),))

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

    # ------------------------------------------------------ optimizer API
    @property
    def _step_supports_amp_scaling(self) -> bool:
        # Makes GradScaler.step() call our step(grad_scaler=...) in fused mode
        # so that we can say what is wrong instead of its "No inf checks".
        return self.fused

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        # (GradScaler passes itself as grad_scaler, and says it will instead
        # set grad_scale and found_inf on the optimizer: either is caught)
        if grad_scaler is not None or (self.fused and (
                getattr(self, "grad_scale", None) is not None
                or getattr(self, "found_inf", None) is not None)):
            # (torch deletes the two after our step() returns: removed here,
            # or every later step() raised)
            for name in ("grad_scale", "found_inf"):
                self.__dict__.pop(name, None)
            raise AutomagicError(
                "Automagic3: GradScaler cannot be used with fused=True: fused mode has "
                "already applied the scaled gradients during backward, before the "
                "scaler could unscale them or check them for inf. Use fused=False")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._other_checked:
            self._check_other_optimizers()
        if self.fused:
            self._steps.close(recorded=True)  # (a pass whose end was recorded has ended)
            self._unwatch_forward()
            if self._close_cut_short():
                self._finish_close()  # (a backward pass's end an interrupt cut short)
            if self._flush_left is not None:
                self._finish_flush()
            refired = self._refired
            self._since_step, self._refired = set(), False
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
                    # (a zero_grad() right after this ends the window: the
                    # caller's loop ends its windows here; see zero_grad)
                    self._stepped_mid = True
                    self._snap_window()
                    self._watch_forward()
                    return loss
                self._warn_once("partial", "step() after %d of the %d backward passes of an "
                                "accumulation window: the window ends here, its gradients "
                                "applied (a trainer's last window of an epoch; warned once)"
                                % (self._micro, self.accumulation_steps))
                self._close_window(flush=True)
            elif self.accumulation_steps == 1 and refired:
                # (a loop that accumulates k passes and then calls step():
                # each pass was an update; found by a review, thirty-third
                # session. Not for passes of different parameters, as one
                # backward per parameter)
                self._warn_once("passes", "step() after %d backward passes in which a "
                                "parameter's hook fired more than once: in fused mode each "
                                "backward pass already updated it (accumulation_steps=1). To "
                                "accumulate gradients over k passes pass accumulation_steps=k, "
                                "or use fused=False (warned once)" % self._passes)
            elif self._aligned_steps is None and self._passes == self.accumulation_steps:
                # the evidence: a whole window between this step() and the
                # last, which came at a window's end too (a step() with no
                # backward pass before it, as torch.distributed.checkpoint's
                # initialisation makes, or one after a load, is none; taken
                # as such, each later step() ended its window: found by a
                # review, twenty-third session)
                self._aligned_steps = True
            self._passes = 0
        self._update_grads()
        return loss

    @torch.no_grad()
    def _update_unhooked(self) -> None:
        """_update_grads(unhooked_only=True) under no_grad, as step() runs
        (a decorator, not a with statement in zero_grad(): an interrupt at
        that statement's line, after grad mode was turned off, left it off;
        seen by a review's interrupt at every line)."""
        self._update_grads(unhooked_only=True)

    def _update_grads(self, unhooked_only: bool = False) -> None:
        """step()'s updates: every parameter with a gradient (in fused mode
        those without a backward hook, and those whose hook a tensor swap
        detached); unhooked_only: those without a hook alone (zero_grad()
        ending a window that step() left open)."""
        # Per group: its parameters with a gradient (in fused mode those
        # without a hook). Everything is checked before anything is updated,
        # so that a bad gradient or hyperparameter leaves every parameter as
        # it was. Loops per group, not per parameter with its group: this
        # runs for every parameter at every step.
        self._adopt_listed()
        self._fill_groups()
        if not unhooked_only and self._initialise_only():
            self._unhooked_pending = False
            return
        todo, index_of, swapped, seen = [], self._param_index, set(), set()
        for group in self.param_groups:
            ps = [p for p in group["params"] if p.grad is not None]
            if unhooked_only:
                ps = [p for p in ps if index_of.get(p) not in self._hooked]
            elif self.fused:
                hooked = [p for p in ps if index_of.get(p) in self._hooked]
                if hooked:
                    swapped |= self._rehook_swapped(hooked)
                    if self._micro == 0 and any(id(p) not in swapped for p in hooked):
                        # (no window open: no hook reported these gradients)
                        self._warn_once(
                            "unreported", "step() in fused mode: a parameter holds a "
                            "gradient no backward hook reported (assigned by hand, as after "
                            "torch.autograd.grad, or kept by an update that failed); fused "
                            "mode applies only what its hooks report, so it stays in .grad, "
                            "not applied. Use fused=False to step on such gradients "
                            "(warned once)")
                ps = [p for p in ps if index_of.get(p) not in self._hooked or id(p) in swapped]
            if ps:
                # A parameter listed twice by hand (in two groups, or twice in
                # one list): updated once, with the first group that lists
                # it (its hook, in fused mode, uses the group it was
                # registered with); the second update found p.grad gone,
                # after every parameter was updated (found by a review,
                # thirty-fourth session). _adopt_listed warns.
                # (the common case, no parameter listed twice, in one set
                # operation: a loop per parameter cost 0.15 us each)
                ids = set(map(id, ps))
                if len(ids) == len(ps) and seen.isdisjoint(ids):
                    seen |= ids
                else:
                    once, dup = [], None
                    for p in ps:
                        if id(p) in seen:
                            dup = p
                        else:
                            seen.add(id(p))
                            once.append(p)
                    self._warn_listed_twice(dup)
                    ps = once
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
        self._unhooked_pending = False

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
                or any(p.grad.layout != torch.strided or bool(p.grad.count_nonzero())
                       for p, _ in ps)):
            return False
        with self._steps.lock:
            for p, group in ps:
                self._init_state(p, group, float(group["base_lr"]))
        return True

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.fused:
            # (a pass whose end an interrupt cut short: not applied here, a
            # forward may have run since; step() applies it: _drop_cut_close)
            self._steps.close(recorded=True, hold=True)
            if self._flush_left is not None or self._close_cut_short():
                self._drop_cut_close()
            # (the passes before it accumulated nothing: no warning at step())
            self._since_step, self._refired = set(), False
            if self._micro == 0 and self._rehook_swapped(
                    [p for g in self.param_groups for p in g["params"] if p.grad is not None]):
                self._warn_once("swapped_zero", "a parameter's tensor was swapped (torch.utils."
                                "swap_tensors: model.to()/half() under torch.__future__."
                                "set_swap_module_params_on_conversion(True), or "
                                "load_state_dict(assign=True)) and its backward hook stopped "
                                "firing: zero_grad() drops the gradient it was not updated "
                                "with; its hook is registered again, so the next backward "
                                "updates it (warned once)")
            forward, self._fwd_since_step = self._fwd_since_step, False
            self._unwatch_forward()
            if self._micro != 0 and self._stepped_mid:
                # step() came after the window's last backward pass, and now
                # zero_grad(): the caller's loop or trainer ends this window
                # there (an epoch shorter than accumulation_steps, or step()
                # and zero_grad() after every pass).
                if forward:
                    # A forward pass ran since that step() (PyTorch
                    # Lightning calls zero_grad() between a window's first
                    # forward and its backward): its graph holds the
                    # weights, so the window cannot be applied now. Its
                    # gradients are kept and the next backward pass adds
                    # to them: the window goes on to accumulation_steps
                    # passes; from now on a step() in a window's middle
                    # ends it (Lightning's later short windows, before the
                    # next forward).
                    self._aligned_steps = True
                    self._warn_once(
                        "stepforward", "zero_grad() after a step() in the middle of an "
                        "accumulation window (%d of %d backward passes) and after a "
                        "forward pass since (PyTorch Lightning's order): applied now, the "
                        "window would change weights that forward's backward needs, so "
                        "its gradients are kept and the window goes on with the next "
                        "backward passes; later step() calls end their windows (warned "
                        "once)" % (self._micro, self.accumulation_steps))
                    self._stepped_mid = False
                    self._zero_grad_outside_window(set_to_none)
                    return
                # Applied, as step mode applies them: discarded, such a run
                # never updated anything behind one warning (found by a
                # review, thirty-second session).
                self._warn_once("stepzero", "step() and zero_grad() after %d of the %d "
                                "backward passes of an accumulation window: the window ends "
                                "there and its gradients are applied, as in step mode (a "
                                "loop or trainer whose windows are shorter than "
                                "accumulation_steps; warned once)"
                                % (self._micro, self.accumulation_steps))
                # and the parameters without a hook (unfrozen after the
                # optimizer was built, or put into a group by hand), which
                # step() updates with the window closed: that step()
                # returned mid-window before them, and they were cleared
                # below, never updated (found by a randomized review,
                # fortieth session). Pending first: an interrupt in the
                # window's flush or their updates leaves it for the retried
                # zero_grad() (a review)
                self._unhooked_pending = True
                try:
                    self._close_window(flush=True, by_zero_grad=True)
                except Exception:
                    # a refusal in the flush (nonfinite="raise"): raised
                    # once; the next zero_grad() clears, as before (kept
                    # pending, it updated them: a review)
                    self._unhooked_pending = False
                    raise
            elif self._micro != 0:
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
            if self._unhooked_pending:
                try:
                    self._update_unhooked()
                except Exception:
                    # refused (a bad gradient or hyperparameter,
                    # nonfinite="raise"): raised once, as step() raises it;
                    # the next zero_grad() clears
                    self._unhooked_pending = False
                    raise
        super().zero_grad(set_to_none=set_to_none)

    def _zero_grad_outside_window(self, set_to_none: bool) -> None:
        """zero_grad() of the gradients that are not the open window's (the
        gradients _flush would apply are kept, and those of parameters
        without a hook, which the step() that ends the window updates: they
        were cleared, never updated; a randomized review, fortieth
        session), as torch.optim's zero_grad clears them."""
        self._adopt_listed_quietly()  # (those put into a group by hand)
        index_of, hooked = self._param_index, self._hooked
        for group in self.param_groups:
            for p in group["params"]:
                g = p.grad
                index = index_of.get(p)
                if g is None or self._window_holds(index) or (
                        index is not None and index not in hooked):
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    if g.grad_fn is not None:
                        g.detach_()
                    else:
                        g.requires_grad_(False)
                    g.zero_()

    # ------------------------------------------------------- inspection
    def get_learning_rates(self) -> List[float]:
        out = []
        for group in self.param_groups:
            # (a parameter with no rows, (0, 5), has no lr: left out, where
            # the mean of none is NaN, as in the reference; C's
            # am_optimizer_lr_mean leaves it out too: a review, thirty-
            # seventh session)
            lrs = [float(self.state[p]["lr"].mean()) for p in group["params"]
                   if p in self.state and "lr" in self.state[p]
                   and self.state[p]["lr"].numel()]
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
        # (one CPU tensor as it is, and the mean summed in float64 a piece at a
        # time: the cat and v.double() took 12 bytes an lr, which a 1-D
        # parameter of 1e8 elements has; a review, thirty-fifth session)
        v = (lrs[0].reshape(-1) if len(lrs) == 1 and lrs[0].device.type == "cpu"
             else torch.cat([t.reshape(-1).to("cpu") for t in lrs]))
        if v.numel() == 0:
            return None
        total = sum(float(c.sum(dtype=torch.float64)) for c in v.split(1 << 20))
        return dict(min=float(v.min()), median=float(v.median()), max=float(v.max()),
                    mean=total / v.numel(), rows=v.numel())

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
            self._unwatch_forward()
            _remove_hooks(self._hook_handles)
            self._hooked = set()
            self._fused = False
            self.accumulation_steps = 1
            self._micro = 0  # (a stale position was saved in the state_dict)
