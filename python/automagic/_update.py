"""The updates of CPU parameters: their C views pointed at the data, one
am_update_batch call (or one am_update per parameter), and what is recorded
after it, whatever interrupts it. A mixin of automagic.Automagic3."""
import ctypes
import math

import torch

from . import _cuda, _lib
from ._checkpoint import is_real_number
from ._errors import AutomagicError, NonFiniteGradientError
from ._views import (_DTYPES, _FLT_MIN, _STATUS_WORD, _STRIDED, _SUPPORTED_DEVICE_TYPES,
                     _Plan, _check_plan_inputs, _fill_batch_item, _group_key, _hparams,
                     _plan_signature, _scale_lrs, _scaled_hparams, _unscaled_lrs,
                     _validate_group)


class _UpdateMixin:
    """Automagic3's update machinery (step() and the hooks call it)."""

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
        # checked again whenever the values changed or one is not a plain
        # int or float: a string or a bool whose float() equals the value
        # before passed in fused mode while step() refused it (found by a
        # randomized review, twenty-fourth session)
        if sig is None or self._hsig_seen.get(id(group)) != sig or _group_key(group) is None:
            for name in _lib.HPARAM_NAMES[1:]:
                v = group[name]
                if not is_real_number(v):
                    raise AutomagicError("Automagic3: %s must be a number, got %r" % (name, v))
            if sig is None:  # lr: neither a number nor a tensor of one
                raise AutomagicError("Automagic3: group['lr'] must be a number (or a one-element "
                                     "floating tensor), got %r" % (group["lr"],))
            # and their values, as step() checks them (a NaN reached the
            # C update in fused mode, after the parameter's state was made)
            try:
                _validate_group(group, check_lr=False)
            except (TypeError, ValueError) as e:
                raise AutomagicError(str(e)) from None
            self._hsig_seen[id(group)] = sig
            self._warn_clamps(group)
        return sig

    def _warn_clamps(self, group: dict) -> None:
        """Warns once when a group's min_lr/max_lr differ from those it was
        added with while an lr scheduler is attached (group["initial_lr"]):
        OneCycleLR writes its own cycle's "min_lr"/"max_lr" into the group,
        the same keys as the clamps of the rows' lrs, which then follow them
        silently (found by a review, twenty-fifth session; the reference
        does the same)."""
        added = self._clamps_added.get(id(group))
        if added is None or "initial_lr" not in group or "clamps" in self._warned:
            return
        now = (float(group["min_lr"]), float(group["max_lr"]))
        if now != added:
            self._warn_once("clamps", "group['min_lr'], group['max_lr'] changed from %g, %g to "
                            "%g, %g while an lr scheduler is attached: OneCycleLR writes its "
                            "own min_lr and max_lr into the group, the same keys as "
                            "Automagic3's clamps of each row's tuned lr, which now follow them "
                            "(as in the reference). OneCycleLR reads them at every step, so "
                            "they cannot be set back without changing its schedule; use a "
                            "scheduler that does not write them if the clamps matter (warned "
                            "once)" % (added + now))

    def _update_param(self, p: torch.Tensor, group: dict) -> None:
        """Updates one parameter (a backward hook, or the end of a fused
        window) under no_grad. Hooks run inside backward, where grad mode is
        already off unless create_graph=True: no context to enter then (it
        was 1 us of the 5 a small parameter's hook cost)."""
        if p.grad is None:
            return
        if torch.is_grad_enabled():
            self._update_one_no_grad(p, group)
        else:
            self._update_one(p, group)

    @torch.no_grad()
    def _update_one_no_grad(self, p: torch.Tensor, group: dict) -> None:
        """_update_one under no_grad (a decorator, not a with statement in
        _update_param: an interrupt at that statement's line, after grad
        mode was turned off, left it off; a review, fortieth session)."""
        self._update_one(p, group)

    def _update_one(self, p: torch.Tensor, group: dict) -> None:
        """_update_param's work, grad mode off: checks, then _apply."""
        if "base_lr" not in group:  # (a group put into param_groups by hand)
            self._fill_group(group)
        if p.is_cuda:  # CUDA path (issue 7): python/automagic/_cuda.py
            _cuda.update_param(self, p, group, AutomagicError)
            return
        self._check(p, p.grad)
        _lib.lib.am_set_num_threads(torch.get_num_threads())
        hsig = self._hsig(group)  # (first: it names a bad value, _lr_scale's float() did not)
        self._apply(p, group, self._lr_scale(group), hsig)

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

    def _prepare_calls(self, jobs, calls: list, copied=None) -> None:
        """The C views of the updates of jobs [(p, group, scale, hsig)],
        pointed at their data, appended to calls: a call (p,
        plan, target, grad, hp, lr_before, state, scale, the state's step
        before the update) each; grad and target must stay alive until the
        update has run. A parameter's _Plan is rebuilt whenever anything it holds may
        have changed (p.data replaced, state tensors replaced or moved, the
        seed), its hyperparameters when the group's values (hsig) changed.
        With copied (a list), the jobs updated through a copy (below) are
        appended to it instead, not prepared (_apply_batch runs them one at
        a time). One loop with its names local, no call per parameter: this
        runs for every parameter at every step (2.4 -> 1.6 us a parameter). A job
        refused midway (its state or p.data changed) raises; the callers'
        _settle puts the lrs of the calls already prepared back from their
        schedule's scaling (they were left scaled, once more at every retry;
        found by a review, twenty-second session)."""
        state_of, plans, index_of, seed = self.state, self._plans, self._param_index, self.seed
        created = []  # parameters whose state this call made
        try:
            for job in jobs:
                p, group, scale, hsig = job
                grad = p.grad
                # Memory the C update cannot take as it is goes through a
                # contiguous copy: strided tensors, and those whose address is
                # not a multiple of the element size (torch.frombuffer at an
                # odd offset: the C update refuses them, and step() raised
                # until the twenty-sixth session); and p itself for a
                # schedule factor of 0 (the state advances but the parameter
                # must not move: the update is written to a copy then
                # dropped). Each address is read once (an address that is a
                # multiple of 4 suits every dtype: the element size is asked
                # for only otherwise).
                gp = grad.data_ptr()
                gcopy = bool(gp & 3 and gp % grad.element_size()) or not grad.is_contiguous()
                pp = p.data_ptr()
                pdirect = (scale != 0.0 and p.is_contiguous()
                           and not (pp & 3 and pp % p.element_size()))
                if copied is not None and (gcopy or not pdirect):
                    copied.append(job)
                    continue
                # (get: indexing the defaultdict left an empty {} behind, in
                # opt.state and state_dict(), when the start lr was refused)
                state = state_of.get(p)
                made = not state
                if made:
                    state = self._init_state(p, group)
                    created.append(p)
                if gcopy:
                    grad = grad.clone(memory_format=torch.contiguous_format)
                    gp = grad.data_ptr()
                # (one copy: contiguous() of a channels_last p is one already)
                if pdirect:
                    target, tp = p, pp
                else:
                    target = p.clone(memory_format=torch.contiguous_format)
                    tp = target.data_ptr()
                index = index_of.get(p)
                if index is None:
                    index = self._index_of(p)
                plan = plans.get(index)
                sig = _plan_signature(p, state, seed, pp)
                if plan is None or plan.sig != sig:
                    if plan is not None:
                        # the batch items of other keys may hold the old view
                        # (and through it the tensors it held): dropped, those
                        # keys rebuild theirs when they come again
                        self._batch_cache.clear()
                    plan = plans[index] = _Plan(p, state, sig,
                                                _lib.RngKey(seed, index & 0xFFFFFFFF))
                if plan.hsig != hsig:
                    plan.hp = _hparams(group)
                    plan.hsig = hsig
                plan.made = made
                plan.pt.data = tp
                gt = plan.gt
                gt.data = gp
                gdt = grad.dtype
                if gdt is not plan.gdt:  # (the same as the last update's, mostly)
                    # (None while gt.dtype is written: an interrupt between
                    # the two left the cache naming a dtype gt did not hold,
                    # and later gradients were read as another dtype; a review)
                    plan.gdt = None
                    gt.dtype = _DTYPES[gdt]
                    plan.gdt = gdt
                s0 = plan.st.step = int(state["step"])
                if scale == 1.0 or scale == 0.0:
                    calls.append((p, plan, target, grad, plan.hp, None, state, scale, s0))
                else:
                    hp, lr_before = _scaled_hparams(group, state, scale)
                    calls.append((p, plan, target, grad, hp, lr_before, state, scale, s0))
                    _scale_lrs(state, scale)  # (recorded first: the rollbacks find it)
        except BaseException:
            # no update has run: the states made here go too (a job refused
            # later in the list left an earlier parameter with a state made
            # at the group's lr of that moment, its rows' start for good;
            # found by a randomized review, twenty-fourth session)
            for p in created:
                state_of.pop(p, None)
            raise

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
            if plan.made:
                # a state this update made (its first): dropped, so that the
                # parameter has none, as before (kept, it started the rows
                # at the skipped step's lr; found by a review, thirty-second
                # session)
                self.state.pop(p, None)
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

    def _apply_each(self, jobs, first=None) -> None:
        """_apply on each of jobs in turn; one refused (AutomagicError) lets
        the others run, and the first error (first, if given, raised before
        these ran) is raised after them, as a batch does."""
        for job in jobs:
            try:
                self._apply(*job)
            except AutomagicError as e:
                first = first or e
        if first is not None:
            raise first

    def _apply_batch(self, jobs, cache_key) -> None:
        """The updates of jobs [(p, group, scale, hsig)], checked CPU
        parameters, in one am_update_batch call: whole parameters on separate
        threads (the same bits as _apply on each in turn; docs/PYTORCH.md).
        The item array and its workspace size are kept, under cache_key
        (step() and each of fused mode's batches of a step have their own),
        while the same plans and hyperparameters come in the same order
        (rebuilding them cost about 2 us per parameter).

        Those updated through a copy (_prepare_calls leaves them out) run
        one at a time after the batch of the others: in the batch every copy
        was alive at once (four channels_last convolution weights took four
        weights' memory, not one; a review, thirty-fifth session). The same
        bits either way. Every view is checked first, so that a refused one
        leaves every parameter as it was; an update the library refuses (a
        step at 2^63 - 1) lets the others run and raises the first error
        after them, as one batch does (the copied ones were skipped: review).
        (The copy test was a pass of its own before the preparation, 0.7 us
        a parameter from cold caches; thirty-ninth session.)"""
        calls, copied, ran, first = [], [], False, None
        # (one try, not one inside another: on CPython 3.11 an interrupt
        # raised at a nested try's own line, as the line tracer of
        # test_frontend_interrupt raises it, escaped both handlers)
        try:
            self._prepare_calls(jobs, calls, copied)
            if copied:
                for p, group, _, _ in copied:
                    self._precheck_plan(p, group)
                left = {id(job) for job in copied}
                jobs = [job for job in jobs if id(job) not in left]
            if calls:
                ran = True
                self._run_batch(jobs, calls, cache_key)
        except AutomagicError as e:
            self._settle(calls)
            if not (copied and ran):
                raise
            first = e  # (the batch's: the copied ones run, then it is raised)
        except BaseException:
            self._settle(calls)
            raise
        if copied:
            self._apply_each(copied, first)

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
            elif int(state["step"]) == s0:  # not applied
                if lr_before is not None:
                    state["lr"].copy_(lr_before)  # lrs back (again, maybe)
                if plan.made:  # a state this update made: dropped (_finish_call)
                    self.state.pop(p, None)
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
            # refuses): every parameter as it was; one at a time instead
            # (_apply_each: each refused one raises what it always raised).
            self._batch_cache.pop(cache_key, None)
            for call in calls:
                if call[5] is not None:  # lr_schedule="scale": lrs back
                    call[6]["lr"].copy_(call[5])
                if call[1].made:  # made again by the update that runs it
                    self.state.pop(call[0], None)
            # settled: each update below settles its own (an error there
            # had the caller's _settle take these calls, not run, and drop
            # the states the updates below had just made and advanced;
            # found by a review)
            calls.clear()
            # An update refused there lets the others run and the first
            # error is raised after them, as in a batch that runs (it
            # stopped at the first: those after it kept their gradients,
            # not updated, by the order of the parameters alone)
            self._apply_each(jobs)
            return
        statuses = torch.frombuffer(items, dtype=torch.int32).view(n, -1)[:, _STATUS_WORD]
        if not bool(statuses.any()):  # all AM_OK: the common case, in bulk
            finish_ok = self._finish_ok
            for call in calls:
                p, plan, target, _, _, lr_before, state, _, _ = call
                if lr_before is None and target is p:
                    # _finish_ok's work when it has only the step to record
                    state["step"] = plan.st.step
                else:
                    finish_ok(call)
                p.grad = None
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
