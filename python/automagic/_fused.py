"""What "one step" means in fused mode, where updates run inside backward.

In fused mode the optimizer never sees a call that says "the step is over";
it only sees post-accumulate-grad hooks firing. This module groups hook
firings into steps:

  A step is one *outermost* backward pass (``loss.backward()`` or
  ``torch.autograd.backward``), including any backward passes nested in it
  (reentrant activation checkpointing runs a backward inside a backward).

It ends when that backward pass ends (an autograd graph-task callback queued
from the first hook that fires in it), or at the latest at the next
``opt.step()`` / ``opt.zero_grad()`` or the first hook of a later backward
pass. Nesting is found from the Python stack: each backward pass run from
Python on this thread has one frame of ``torch.autograd.graph.
_engine_run_backward``; the outermost such frame identifies the step. Hooks
that run on autograd's device threads (no Python backward frame on their
stack) fall back to the graph-task id, so there a nested backward counts as
its own step.
"""
import sys
import threading

import torch

try:  # torch >= 2.3 routes every Python backward call through this function
    from torch.autograd.graph import _engine_run_backward as _engine_fn
    _ENGINE_CODE = _engine_fn.__code__
except (ImportError, AttributeError):  # pragma: no cover - older torch
    _ENGINE_CODE = None


def _outer_backward():
    """(outermost backward frame on this thread or None, nesting depth)."""
    if _ENGINE_CODE is None:
        return None, 0
    f = sys._getframe(2)
    outer, depth = None, 0
    while f is not None:
        if f.f_code is _ENGINE_CODE:
            outer, depth = f, depth + 1
        f = f.f_back
    return outer, depth


def _same(a, b) -> bool:
    return a is b or (isinstance(a, tuple) and a == b)


class BackwardSteps:
    """Tracks the open step and which parameters' hooks fired in it.

    on_close() is called (with the lock held) each time a step ends. The
    frame that identifies an open step is referenced until the step closes,
    so its identity cannot be reused by a later backward pass.
    """

    def __init__(self, on_close):
        self.lock = threading.RLock()
        self.fired = set()      # parameter indices whose hook fired this step
        self._key = None        # outermost backward frame, or ("task", id)
        self._queued = set()    # graph tasks with an end-of-backward callback
        self._on_close = on_close
        # Steps closed so far, and (graph task, that count) at this thread's
        # last enter(): the next hook of the same task while no step has
        # closed since belongs to the same step (enter's fast path). A count,
        # not the step's key: the key can be a backward pass's frame, which
        # holds its caller's locals (a batch, a loss) alive until replaced.
        self._gen = 0
        self._last = threading.local()

    @property
    def is_open(self) -> bool:
        return self._key is not None

    def enter(self) -> None:
        """Called first thing in every hook: opens (or continues) a step.

        A hook of the graph task whose hook this thread saw last, while the
        step that hook opened or continued is still open, continues it: the
        same backward pass, so the same outermost frame and nesting, and its
        end-of-backward callback already queued. Only the first hook of each
        task walks the stack (about 1 us a hook, more under a deep stack)."""
        task = torch._C._current_graph_task_id()
        last = self._last
        with self.lock:
            if (task >= 0 and self._key is not None and getattr(last, "task", None) == task
                    and last.gen == self._gen):
                return
        frame, depth = _outer_backward()
        key = frame if frame is not None else ("task", task)
        with self.lock:
            if self._key is not None and not _same(self._key, key):
                self._close_locked()
            if self._key is None:
                self._key = key
            # Only the outermost pass may end the step: a nested (reentrant)
            # pass ends while its outer pass still has gradients to deliver.
            if depth <= 1 and task >= 0 and task not in self._queued:
                self._queued.add(task)
                torch.autograd.Variable._execution_engine.queue_callback(
                    lambda k=key: self.close(k))
            last.task, last.gen = task, self._gen

    def close(self, key=None) -> None:
        """Ends the open step (only if it is key's, when key is given)."""
        with self.lock:
            if self._key is None or (key is not None and not _same(self._key, key)):
                return
            self._close_locked()

    def _close_locked(self) -> None:
        self._gen += 1
        self._key = None
        self._queued.clear()
        self.fired.clear()
        self._on_close()
