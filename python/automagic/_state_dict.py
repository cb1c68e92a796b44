"""Automagic3's state_dict / load_state_dict and pickling. A mixin of
automagic.Automagic3 (the conversions and checks of a saved state are in
_checkpoint.py)."""
import warnings

from . import _lib
from ._checkpoint import CheckpointError, as_count, as_indices, as_key, prepare_load
from ._errors import caller_level
from ._views import _state_sizes

# Group keys that are Automagic3 hyperparameters: on load_state_dict the
# optimizer's own (constructor / add_param_group) values win over saved ones.
_HPARAM_KEYS = _lib.HPARAM_NAMES + ("base_lr",)

_STATE_DICT_FORMAT = 1

_ABSENT = object()  # (a key a state_dict saved before it was kept lacks)


def _add_automagic_entry(opt, sd: dict) -> None:
    """A state_dict post hook, registered first: the front end's own entry
    (a module function, so that the optimizer's hook dict holds no
    reference to it)."""
    sd["automagic"] = opt._automagic_entry()


class _StateDictMixin:
    """Automagic3's checkpoints (state_dict, load_state_dict, pickle)."""

    def state_dict(self) -> dict:
        # The "automagic" entry is added by a state_dict post hook registered
        # first (_add_automagic_entry), so that the user's post hooks see it
        # (they ran before it was added: found by a review, twenty-third
        # session; a first fix swapped the hook dict out during the call,
        # and two threads' calls at once lost the hooks for good).
        self._fill_groups(strict=False)  # (groups put in by hand: saved with their start lr)
        sd = super().state_dict()
        if (isinstance(sd, dict) and "automagic" not in sd and _add_automagic_entry
                not in self._optimizer_state_dict_post_hooks.values()):
            _add_automagic_entry(self, sd)  # (the hook removed by hand)
        return sd

    def _automagic_entry(self) -> dict:
        return dict(format=_STATE_DICT_FORMAT, seed=self.seed,
                    nonfinite_skips=self.nonfinite_skips,
                    skipped_by_param=dict(self._skipped), micro_step=self._micro,
                    deferred=sorted(self._deferred), aligned_steps=self._aligned_steps,
                    passes=self._passes, window_fired=self._saved_window(sorted))

    def _saved_window(self, kind):
        """The open window's parameters as a state_dict or a pickle keeps
        them (kind: sorted or set; None where not known): those whose hook
        fired in it, and, mid-window, those without a hook that hold a
        gradient. A new optimizer (or a copy) hooks a parameter that
        requires grad now, and its window's end applies only what the window
        names: one unfrozen after the old optimizer was built was left out,
        its gradient not applied in that window and added to the next
        one's (found by a randomized review, fortieth session)."""
        fired = self._window_fired
        if fired is None:
            return None
        if self._micro:
            self._adopt_listed_quietly()  # (those put into a group by hand)
            index_of, hooked = self._param_index, self._hooked
            fired = fired | {index_of[p] for g in self.param_groups for p in g["params"]
                             if p.grad is not None and p in index_of
                             and index_of[p] not in hooked}
        return kind(fired)

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
        # groups put in by hand: their start lr first, which a restored
        # schedule's lr is a factor of (prepare_load)
        self._fill_groups()
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
        fmt = extra.get("format", _STATE_DICT_FORMAT)
        try:  # (an int, or what a checkpoint library made of one: a tensor)
            fmt_ok = (not isinstance(fmt, bool) and bool(int(fmt) == fmt)
                      and 1 <= int(fmt) <= _STATE_DICT_FORMAT)
        except (TypeError, ValueError, RuntimeError):
            fmt_ok = False
        if not fmt_ok:
            # (a later version's entry was loaded as if it were this one's,
            # as the C loader refuses an unknown version; found by a review,
            # thirtieth session)
            raise CheckpointError("Automagic3: the state_dict's 'automagic' entry has format "
                                  "%r; this version reads format %d" % (fmt, _STATE_DICT_FORMAT))
        try:
            skips = as_count(extra.get("nonfinite_skips", 0))
            skipped = {as_key(k): as_count(v)
                       for k, v in extra.get("skipped_by_param", {}).items()}
            micro = as_count(extra.get("micro_step", 0))
            deferred = as_indices(extra.get("deferred", ()))
            # whether the saved run's step() calls came at window ends (a
            # resumed trainer's first step() may close a shorter window; the
            # live value stays when the dict does not say: found by a review)
            aligned = extra.get("aligned_steps")
            if aligned is None:
                aligned = self._aligned_steps
            elif not isinstance(aligned, bool):
                raise TypeError("aligned_steps must be true, false or null, got %r"
                                % (aligned,))
            # the backward passes since the last step() and the hooks fired
            # in the open window, as saved (a dict saved mid-window came
            # back with them forgotten: the window's end then applied a
            # gradient no hook reported, and a trainer's evidence was lost;
            # found by a randomized review, twenty-fourth session); a dict
            # without them (older): not known, as before
            passes = as_count(extra.get("passes", 0))
            fired = extra.get("window_fired", _ABSENT)
            if fired is not None and fired is not _ABSENT:
                fired = as_indices(fired)
        except (TypeError, ValueError, AttributeError, OverflowError, RuntimeError) as e:
            raise CheckpointError("Automagic3: the state_dict's 'automagic' entry holds an "
                                  "invalid value (%s)" % e) from None
        nparams = len(self._param_index)  # indices are never reused
        fired_set = fired if isinstance(fired, set) else set()
        if (skips < 0 or micro < 0 or passes < 0 or any(v < 0 for v in skipped.values())
                or any(not 0 <= i < nparams for i in set(skipped) | deferred | fired_set)):
            raise CheckpointError("Automagic3: the state_dict's 'automagic' entry holds a "
                                  "negative count or a parameter index out of range "
                                  "(nonfinite_skips %r, micro_step %r, passes %r, "
                                  "skipped_by_param %r, deferred %r, window_fired %r)"
                                  % (skips, micro, passes, skipped, sorted(deferred),
                                     sorted(fired_set)))
        seed = extra.get("seed", self.seed)
        try:  # (a tensor of several seeds raised RuntimeError here)
            same_seed = as_count(seed) == self.seed
        except ValueError:
            same_seed = False
        if not same_seed:
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
                    self._updated, self._window_fired, self._aligned_steps, self._passes,
                    self._queue, self._queue_bytes)
        with self._steps.lock:
            # (held back: a window's rest after a pass that raised, or one
            # whose end an interrupt cut short, is dropped below, not
            # applied to weights the caller may have just restored; a
            # review, forty-second session)
            self._steps.close(recorded=True, hold=True)
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
                # (a queue an interrupt left full, the step closed: its
                # parameters were queued again by the next pass, twice)
                self._queue, self._queue_bytes = [], 0
                self._flush_left = None
                self._unhooked_pending = False
                if self._micro == 0:
                    self._window_fired = set()
                else:  # (not known when the dict does not say)
                    self._window_fired = None if fired is _ABSENT else fired
                # (the passes since the last step(): when the dict does not
                # say, counted from here, so that a later step() is evidence
                # only after a whole window between two step() calls of
                # this run)
                self._aligned_steps, self._passes = aligned, passes
                # the C views of the replaced state hold its tensors (_Plan.held),
                # and the batch items the views: rebuilt at the next update (the
                # old state stayed alive, a parameter never updated again kept
                # it for good; found by a review, twenty-fourth session)
                self._plans.clear()
                self._batch_cache.clear()
            except BaseException:
                for g, og in zip(self.param_groups, old_groups):
                    g.clear()
                    g.update(og)
                self.state.clear()
                self.state.update(old_state)
                (self.nonfinite_skips, self._skipped, self._micro, self._deferred,
                 self._updated, self._window_fired, self._aligned_steps,
                 self._passes, self._queue, self._queue_bytes) = old_book
                raise
            # (a zero_grad() after the load discards the window, as it did:
            # the gradients are not the loaded state's; found by a review)
            self._stepped_mid = False
            # (a close an interrupt cut short is not finished after the load:
            # the loaded window replaces its bookkeeping)
            self._counted, self._ending = self._steps.gen, False
            self._since_step, self._refired = set(), False  # (passes of another run)
        self._warn_lost_window()

    def _warn_lost_window(self, what: str = "the state_dict was saved") -> None:
        """After a load mid-window: the gradients the window's passes so far
        accumulated live in p.grad, which no state_dict holds. Loaded in a
        new process without them, the window's end applied the remaining
        passes' gradients alone, silently (found by a review, thirty-third
        session): warned, with what to do."""
        if self._micro == 0:
            return
        index = self._param_index
        fired = self._window_fired
        params = [p for g in self.param_groups for p in g["params"]
                  if p.requires_grad and (fired is None or index.get(p) in fired)]
        missing = sum(1 for p in params if p.grad is None)
        # (the fired parameters known: each needs its gradient; not known
        # (an older dict): only when no parameter has one)
        if params and (missing if fired is not None else missing == len(params)):
            warnings.warn("Automagic3: %s after %d of the %d backward passes of an "
                          "accumulation window, and %d of the window's parameters have no "
                          ".grad now: neither a state_dict nor a pickle holds the "
                          "gradients accumulated so far, so the window's end will apply "
                          "only the remaining passes' gradients. Restore each p.grad "
                          "saved with it, or save at a window's end"
                          % (what, self._micro, self.accumulation_steps, missing),
                          UserWarning, stacklevel=caller_level())

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
                    aligned=self._aligned_steps, hooked=set(self._hooked),
                    passes=self._passes, window_fired=self._saved_window(set))

    def __setstate__(self, d: dict) -> None:
        extra = {k: d.pop(k) for k in ("micro", "deferred", "warned", "skipped")}
        aligned = d.pop("aligned", None)  # (pickled before it was kept: not known)
        hooked = d.pop("hooked", None)  # (pickled before: the parameters requiring grad)
        passes = d.pop("passes", 0)  # (pickled before: as load_state_dict without them)
        fired = d.pop("window_fired", _ABSENT)
        d.setdefault("batch_updates", True)  # pickled before these were kept
        d["_fused_batch_bytes"] = d.pop("fused_batch_bytes", 4 << 20)
        d["_fused"] = d.pop("fused")
        super().__setstate__(d)
        self.register_state_dict_post_hook(_add_automagic_entry, prepend=True)
        self._init_runtime()
        self._micro, self._deferred = extra["micro"], extra["deferred"]
        self._warned, self._skipped = extra["warned"], extra["skipped"]
        if self._micro == 0:
            self._window_fired = set()
        else:
            self._window_fired = None if fired is _ABSENT else fired
        self._aligned_steps, self._passes = aligned, passes  # (as load_state_dict)
        for group in self.param_groups:
            self._register_params(group, hooked)
            # (the clamps as unpickled: a scheduler attached later that
            # writes them is warned about, as on the original)
            if "min_lr" in group and "max_lr" in group:  # (a group put in by hand may lack
                # them until its first step: _fill_group)
                self._clamps_added[id(group)] = (float(group["min_lr"]), float(group["max_lr"]))
        # (neither pickle nor deepcopy keeps a Parameter's .grad: copied
        # mid-window, the window's end applied the remaining passes alone,
        # silently)
        self._warn_lost_window("the optimizer was pickled or copied")
