"""Fused mode: a post-accumulate-grad hook per parameter that updates it
the moment its gradient is whole, small updates queued and run together,
accumulation windows. A mixin of automagic.Automagic3."""
import warnings
import weakref
from collections import OrderedDict
from typing import Optional

import torch

from . import _lib
from ._errors import AutomagicError
from ._recovery import _RecoveryMixin


class _FusedMixin(_RecoveryMixin):
    """Automagic3's fused-mode hooks and queue."""

    def _register_params(self, group: dict, hooked: Optional[set] = None) -> None:
        """Indexes group's parameters and, in fused mode, hooks those that
        require grad; hooked (an unpickled optimizer's): the indices the
        original had hooked, hooked again even if frozen now (a parameter
        frozen when the optimizer was copied lost its hook, and once
        unfrozen the copy never updated it in backward where the original
        did; found by a randomized review, twenty-fourth session)."""
        for pos, p in enumerate(group["params"]):
            index = self._param_index.get(p)
            if index is not None:
                # Moved here from another group (removed from its list, then
                # add_param_group): it keeps its index (its noise key) and,
                # where its hook is still attached, that hook, which finds
                # the group that lists it now. A second hook queued it twice
                # and the second update found p.grad gone, inside backward
                # (found by a review, thirty-fourth session).
                hooks = getattr(p, "_post_accumulate_grad_hooks", None) or ()
                if index in self._hooked and self._hook_ids.get(index) in hooks:
                    continue
            else:
                index = len(self._param_index)
                self._param_index[p] = index
            frozen_hooked = (hooked is not None and index in hooked and not p.requires_grad
                             and p.is_leaf)
            if self.fused and (p.requires_grad or frozen_hooked):
                if frozen_hooked:
                    p.requires_grad_(True)  # (a hook needs it; it survives the freeze)
                try:
                    handle = p.register_post_accumulate_grad_hook(
                        self._make_hook(group, pos, index))
                finally:
                    if frozen_hooked:
                        p.requires_grad_(False)
                self._hooked.add(index)
                self._hook_handles.append(handle)
                self._hook_ids[index] = handle.id
                self._hook_cdata[index] = p._cdata

    def _check_other_optimizers(self) -> None:
        """At this optimizer's first backward hook or step(): warns (once)
        when one of its parameters has the backward hook of another
        Automagic3 in fused mode that is still alive. That hook runs first,
        updates the parameter and drops its gradient, so this optimizer
        never updates it: an old optimizer kept alive (by an lr scheduler, a
        notebook's output) and a new one created for the same model, which
        silently did nothing (found by a review, thirty-second session).
        Not at construction: `opt = Automagic3(model.parameters())` run
        again builds the new one while the old one is still bound to opt,
        which is dropped (and its hooks removed) right after."""
        self._other_checked = True
        for group in self.param_groups:
            for p in group["params"]:
                hooks = getattr(p, "_post_accumulate_grad_hooks", None)
                for fn in (hooks.values() if hooks else ()):  # (in the order they run)
                    ref = getattr(fn, "_automagic_optimizer", None)
                    other = ref() if ref is not None else None
                    if other is self:
                        break  # ours runs first: this optimizer updates p
                    if other is not None:
                        self._warn_once(
                            "other", "a parameter of shape %s has the backward hook of "
                            "another Automagic3 optimizer in fused mode, which is still "
                            "alive: its hook updates the parameter and drops its gradient "
                            "first, so this optimizer does not update it. Call "
                            "remove_hooks() on the other optimizer, or drop it and what "
                            "holds it (an lr scheduler, say) (warned once)"
                            % (tuple(p.shape),))
                        return

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
        _hook._automagic_optimizer = ref  # (for _check_other_optimizers)
        return _hook

    # ----------------------------------------------------------- fused
    def _on_grad_ready(self, p: torch.Tensor, group: dict, index: int) -> None:
        """A hook fired for parameter index: update now, queue a small CPU
        parameter's update for the next batch, or leave p.grad to
        accumulate."""
        if not self._other_checked:
            self._check_other_optimizers()
        if self._unhooked_pending:
            # a backward pass since a window's end an interrupt cut short:
            # what it had not applied is added to the new pass's gradients,
            # applied with them (the hooked ones at their window's end, the
            # others at a step(); _flush_left below)
            self._unhooked_pending = False
        steps = self._steps
        task = steps.enter()
        batch = key = None
        with steps.lock:
            again = index in steps.fired
            if again:
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
            if not steps.fired and self._close_cut_short():
                self._settle_cut_close()
            if not steps.fired and self._stepped_mid and self._window_cleared(index):
                # the first hook of a pass after a step() in a window's
                # middle, and the window's other gradients are gone: cleared
                # by something other than our zero_grad() (HF Trainer's
                # model.zero_grad() after an epoch's shorter last window).
                # Its passes are lost; the caller ends its windows at its
                # step() calls (the window went on, and later windows
                # straddled the caller's; found by a review, thirty-third
                # session)
                self._warn_once(
                    "cleared", "the gradients of %d backward passes of an accumulation "
                    "window were cleared after a step() in its middle, and not by this "
                    "optimizer's zero_grad() (model.zero_grad(), as HF Trainer calls "
                    "after an epoch's shorter last window?): those passes are lost. The "
                    "window is taken to end at that step(); from now on a step() in a "
                    "window's middle ends it and applies its gradients, as in step mode. "
                    "Call the optimizer's zero_grad() to keep them (warned once)"
                    % self._micro)
                self._aligned_steps = True
                self._close_window(flush=False)
            steps.fired.add(index)
            if self._flush_left is not None:
                # (pending since an interrupt: this pass adds its gradient
                # and goes on with it; a parameter the pass does not reach
                # stays for step(): all were dropped here, and zero_grad()
                # cleared those; a review. After fired.add: an interrupt
                # between the two lost it, a review)
                self._flush_left.discard(index)
            if again:
                pass  # (a second part in this pass: not another pass's update)
            elif index in self._since_step:  # (fired in an earlier pass: see step())
                self._refired = True
            else:
                self._since_step.add(index)
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

    def _snap_window(self) -> None:
        """At a step() in a window's middle: each gradient of the window as
        it is (a weak reference: a strong one would keep a cleared gradient
        alive, and an id could be reused), and its version, for
        _window_cleared."""
        fired, snap = self._window_fired, {}
        if fired:
            for group in self.param_groups:
                for q in group["params"]:
                    i = self._param_index.get(q)
                    g = q.grad
                    if i in fired and g is not None:
                        snap[i] = (weakref.ref(g), g._version)
        self._mid_grads = snap

    def _window_cleared(self, index: int) -> bool:
        """At the first hook (of parameter index) of a backward pass after a
        step() in a window's middle: whether the window's gradients were
        cleared from outside since that step(): every parameter but index
        whose hook fired in the window has lost its gradient, or holds all
        zeros in another tensor or at another version than that step() left
        (model.zero_grad(set_to_none=False), unseen until the thirty-seventh
        session: a review). Not judged where index alone fired: its own
        gradient now holds this pass's, added by autograd, and a hook of the
        caller's may have changed it too (an evidence from its version
        took such a hook's in-place change for a clear: a review). False
        when none fired, or not known (a load mid-window)."""
        fired = self._window_fired
        if not fired or self._micro == 0 or fired == {index}:
            return False
        snap = self._mid_grads
        for group in self.param_groups:
            for q in group["params"]:
                i = self._param_index.get(q)
                if i == index or i not in fired:
                    continue
                g = q.grad
                if g is None:
                    continue
                ref, version = snap.get(i, (None, None))
                if ref is None or (ref() is g and g._version == version) or bool(g.any()):
                    return False  # (kept as it was, or holding something)
        return True

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
                grad = p.grad
                if grad is None:
                    # freed since it was queued: by a hook registered after
                    # ours, or another optimizer (not applied: it may have
                    # been, by that optimizer). Silent before; the
                    # reference, which updates in its hook, had applied it
                    # (found by a review, thirty-third session)
                    self._warn_once(
                        "queued_freed", "a parameter's gradient was set to None after its "
                        "backward hook queued its update and before the update ran (by a "
                        "hook registered after the optimizer's, or another optimizer?): "
                        "that update was not applied. Set opt.fused_batch_bytes = 0 to "
                        "update each parameter in its own hook, before hooks registered "
                        "later (warned once)")
                    continue
                try:
                    if "base_lr" not in group:  # (put into param_groups by hand)
                        self._fill_group(group)
                    self._check(p, grad)
                    if not self.batch_updates:  # one at a time: each checked first
                        self._precheck_plan(p, group)
                    if id(group) not in hyper:
                        hsig = self._hsig(group)  # (first: it names a bad value)
                        hyper[id(group)] = (self._lr_scale(group), hsig)
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

    def _on_step_closed(self, ended: bool, hold: Optional[bool] = None) -> None:
        """A step closed: the queued updates run if its backward pass ended
        (ended) or is still running (a hook of another pass closed it), else
        they are dropped (the pass raised: running them now could change
        weights a later forward has used); maybe the window ends too.

        The pass is counted first (in one line, with the step's number in
        _counted and _ending set), the window ends last (_ending cleared),
        so that an interrupt (KeyboardInterrupt) anywhere leaves a state
        the next step() or zero_grad() finishes (_finish_close): a close
        not counted, a pass counted whose end did not finish, or, where
        the pass ended, updates of the queue's run not yet applied
        (_keep_unapplied). Before, an interrupt in the run lost those
        updates, and one in the count left the window open with its
        parameters marked updated (a review, fortieth session).

        hold (None: as the step's close said, BackwardSteps.closed[1]):
        nothing applied now, neither the queue nor a window that ends here
        (a new backward pass runs, or zero_grad() may follow a forward:
        their graphs may hold the weights, and autograd's version check
        failed them; a review): what an ended pass had not applied is kept
        for step() (_keep_unapplied), with the window's rest; a failed
        pass's queued gradients stay, not applied, and its window's rest is
        kept for step() where its close was held back (BackwardSteps
        holds back an outermost pass that raised, forty-second session)."""
        self._count_pass()
        self._close_pass(ended, self._steps.closed[1] if hold is None else hold)

    def _count_pass(self) -> None:
        """A backward pass counted, with the step number its close made
        (the stores in one line: an interrupt leaves all or none)."""
        self._micro, self._passes, self._ending, self._counted = (
            self._micro + 1, self._passes + 1, True, self._steps.gen)

    def _close_pass(self, ended: bool, hold: bool = False) -> None:
        """_on_step_closed's work once the pass is counted."""
        try:
            batch, key = self._take_queue()
            self._batches = 0
            if hold:  # (the window's rest kept; a pass that raised: its queue dropped)
                self._keep_unapplied(window=True, queue=ended)
            if batch and not hold and (ended or self._steps.pass_running()):
                self._run_queue(batch, key)
            elif batch and not ended:
                warnings.warn(
                    "Automagic3: a backward pass did not reach its end (an exception "
                    "inside backward?): the updates of %d parameters queued in it were not "
                    "run. Their gradients are kept in .grad, and a later backward pass adds "
                    "to them as PyTorch accumulates; call zero_grad() to drop them"
                    % len(batch), RuntimeWarning, stacklevel=4)
        except BaseException as e:
            # An interrupt: kept what the close keeps (a pass that did not
            # end keeps its gradients unapplied, as one that raised: the
            # interrupt fails it if it still runs), and the queue emptied
            # (one before it was taken left a failed pass's queue, run
            # with the next pass's; forty-second session, test_an_interrupt_
            # at_any_line_of_the_close_after_a_failed_pass)
            if not isinstance(e, Exception):
                if ended or hold:
                    self._keep_unapplied(window=hold, queue=ended)
                else:
                    self._queue, self._queue_bytes = [], 0
            raise
        finally:
            self._end_micro_step(flush=not hold)

    def _watch_forward(self) -> None:
        """At a step() in a window's middle: notes whether a forward pass
        with grad enabled runs before the next zero_grad()
        (_fwd_since_step), by a module forward pre-hook of torch's, global,
        that removes itself at its first call with grad enabled. PyTorch Lightning calls
        zero_grad() after the forward of a window's first batch, and
        zero_grad() must then not change the weights that forward's graph
        holds (applied there, backward raised autograd's in-place error;
        found by a review with real Lightning, thirty-eighth session). The
        note is cleared where it is used up, at zero_grad() and at the end
        of a backward pass, not here: a second step() between the forward
        and zero_grad() lost it (a review)."""
        if self._fwd_hook is not None:
            return
        ref, cell = weakref.ref(self), []

        def _pre(module, args):
            opt = ref()
            if opt is not None:
                if not torch.is_grad_enabled():
                    return  # (an evaluation pass builds no graph)
                opt._fwd_since_step = True
                if opt._fwd_hook is cell[0]:
                    opt._fwd_hook = None
            cell[0].remove()
        cell.append(torch.nn.modules.module.register_module_forward_pre_hook(_pre))
        self._fwd_hook = cell[0]

    def _unwatch_forward(self) -> None:
        handle, self._fwd_hook = self._fwd_hook, None
        if handle is not None:
            handle.remove()

    def _end_micro_step(self, flush: bool = True) -> None:
        """After a backward pass was counted (_on_step_closed): the notes
        taken since the last step() reset, and the window ended (flushed)
        once it holds accumulation_steps passes; then _ending cleared (not
        after an interrupt: the retry ends the pass again)."""
        self._stepped_mid = False  # (a backward pass since that step())
        self._fwd_since_step = False
        self._unwatch_forward()
        try:
            if self._micro >= self.accumulation_steps:
                self._close_window(flush=flush)
        except Exception:
            self._ending = False  # (a refusal: raised once, as before)
            raise
        self._ending = False

    def _close_window(self, flush: bool, by_zero_grad: bool = False) -> None:
        """Ends the accumulation window: with flush, its gradients applied
        (_flush); without, dropped by the caller (zero_grad). An interrupt
        (KeyboardInterrupt) in the flush leaves what it has not applied to
        the retried step() or zero_grad() (_flush_left): the window was
        closed, and a retried zero_grad() cleared those gradients unapplied
        (a review, fortieth session). The window is marked closed last (an
        interrupt before the flush leaves it open, for the retry to close).
        by_zero_grad: zero_grad() ends the window (its retry may finish the
        flush; the rest of one at a backward pass's end only step() does)."""
        done = set(self._updated)  # (marked before the flush: see below)
        try:
            if flush:
                self._flush()
        except BaseException as e:
            if flush and not isinstance(e, Exception):
                # what _flush had yet to apply, with what _keep_unapplied
                # kept; not those marked updated before it (a failed pass's
                # dropped queue, which the retried step() applied; a review)
                fired, hooked, left = self._window_fired, self._hooked, set(self._flush_left or ())
                for group in self.param_groups:
                    for p in group["params"]:
                        i = self._param_index.get(p)
                        if (p.grad is not None and i in hooked and i not in done
                                and (fired is None or i in fired)):
                            left.add(i)
                self._flush_left, self._left_by_zero_grad = left, by_zero_grad
            raise
        finally:
            self._window_fired = set()
            self._updated.clear()
            self._micro = 0
            self._stepped_mid = False

    def _flush(self) -> None:
        """Updates hooked parameters whose hook fired in this window and
        whose gradient is not yet applied (deferred ones, and those whose
        hook fired in an earlier micro-batch of the window but not in the
        last). A gradient no hook reported (set by hand, or left from before)
        is left alone, as the reference leaves it."""
        for group in self.param_groups:
            for p in group["params"]:
                index = self._param_index.get(p)  # (None: put in by hand, no hook)
                if p.grad is not None and self._window_holds(index):
                    self._updated.add(index)
                    self._update_param(p, group)

    def _window_holds(self, index) -> bool:
        """Whether the gradient of parameter index (None: no hook) belongs
        to the open window and is not applied yet (what _flush applies)."""
        fired = self._window_fired
        return (index in self._hooked and index not in self._updated
                and (fired is None or index in fired))
