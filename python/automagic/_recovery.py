"""Fused mode after a backward pass's end was cut short (a KeyboardInterrupt
in its end-of-backward work or in a window's flush) or after a pass that
raised: what was not applied is kept for step(), settled at the next pass
or zero_grad(), or finished at step(). A mixin of automagic.Automagic3
(through _FusedMixin)."""


class _RecoveryMixin:
    """Fused mode's recovery of a close or a flush cut short."""

    def _keep_unapplied(self, window: bool = False, queue: bool = True) -> None:
        """After an interrupt in the queued updates' run at the end of a
        backward pass, or at a close held back (_close_pass): the updates
        the window marked done (_updated) whose gradient is still there
        were not applied; they join _flush_left,
        for the next step() to apply (zero_grad() drops them: a forward pass
        may have run since, whose graph holds the weights; the next backward
        pass instead adds its gradients to them). They were lost: marked done,
        the window's flush skipped them, and step() left their gradients to
        zero_grad() ("unreported"; a review, fortieth session). The queue is
        emptied (an interrupt as it was taken left it full). window: also
        what the window's flush would apply, if the window ends with this
        pass (its close held back: _close_pass). Not queue (a pass that
        raised: its queued updates are dropped, their gradients stay): the
        window's alone, and nothing set when there is none."""
        self._queue, self._queue_bytes = [], 0
        left, done, hooked = set(self._flush_left or ()), self._updated, self._hooked
        window = window and self._micro >= self.accumulation_steps
        for group in self.param_groups:
            for p in group["params"]:
                i = self._param_index.get(p)
                if p.grad is not None and ((queue and i in done and i in hooked)
                                           or (window and self._window_holds(i))):
                    left.add(i)
        if queue or left or self._flush_left is not None:
            self._flush_left, self._left_by_zero_grad = left, False

    def _close_cut_short(self) -> bool:
        """Whether the last step's close was cut short by an interrupt:
        not counted (_on_step_closed never ran or stopped before its first
        line) or not finished (_ending)."""
        return self._ending or self._counted != self._steps.gen

    def _finish_close(self) -> None:
        """At step(), after a close cut short (_close_cut_short): the rest
        of it, with the queued updates run if that step's pass ended
        (BackwardSteps.closed). zero_grad() settles it instead
        (_drop_cut_close)."""
        with self._steps.lock:
            ended = self._steps.closed[0]
            if self._counted != self._steps.gen:
                self._on_step_closed(ended, hold=False)
            elif self._ending:
                self._close_pass(ended)

    def _drop_cut_close(self) -> None:
        """At zero_grad(): a close cut short (_close_cut_short) is settled
        with nothing applied (_settle_cut_close), and the rest of a window's
        flush cut short at a backward pass's end is dropped (zero_grad()
        clears those gradients): a forward pass may have run since (PyTorch
        Lightning's order), whose backward would fail on autograd's version
        check if the weights changed now. Warned once, where a gradient is
        dropped (the next passes' hooks may have taken every one back: an
        empty set warned; a review, forty-second session). The rest of a
        zero_grad()'s own window end is finished (_finish_flush)."""
        if self._close_cut_short():
            with self._steps.lock:
                self._settle_cut_close()
        left, dropped = self._flush_left, False
        if left is not None:
            if self._left_by_zero_grad:
                self._finish_flush()
            else:
                dropped = any(True for _ in self._left_params(left))
                self._flush_left = None
        if dropped:
            self._warn_once(
                "cutzero", "zero_grad() after a backward pass that failed (an exception "
                "inside backward) or whose end-of-backward work was cut short "
                "(KeyboardInterrupt, or an exception in another optimizer's callback): the "
                "updates it had not applied yet (of its accumulation window, for a failed "
                "pass) are dropped with their gradients (a step() before zero_grad() "
                "applies them; warned once)")

    def _settle_cut_close(self) -> None:
        """At the first hook of a backward pass, or at
        zero_grad(), after a close cut short (_close_cut_short): the old
        pass counted and its window ended, with nothing applied (an update
        now could change a weight this pass, or a forward since, still
        needs: autograd's in-place error). What a pass that ended had not
        applied is kept for step() (_keep_unapplied; this pass's own
        parameters add their gradients and go on with it as their hooks
        fire: _on_grad_ready); a failed pass's queued gradients stay, and
        its window's rest is kept too where its close was held back."""
        if self._counted != self._steps.gen:
            self._count_pass()
        ended, hold = self._steps.closed
        if ended or hold:
            self._keep_unapplied(window=True, queue=ended)
        self._queue, self._queue_bytes = [], 0
        self._end_micro_step(flush=False)

    def _left_params(self, left):
        """(p, group) of each parameter whose index is in left and whose
        gradient is still there."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and self._param_index.get(p) in left:
                    yield p, group

    def _finish_flush(self) -> None:
        """At step() or zero_grad(): the rest of a window's flush that an
        interrupt cut short (_close_window), each parameter whose gradient
        is still there. A refused update is raised once (the next call
        goes on without it)."""
        try:
            for p, group in self._left_params(self._flush_left):
                self._update_param(p, group)
        except Exception:
            self._flush_left = None
            raise
        self._flush_left = None
