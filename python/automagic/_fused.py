"""What "one step" means in fused mode, where updates run inside backward.

In fused mode the optimizer never sees a call that says "the step is over";
it only sees post-accumulate-grad hooks firing. This module groups hook
firings into steps:

  A step is one *outermost* backward pass (``loss.backward()`` or
  ``torch.autograd.backward``), including any backward passes nested in it
  (reentrant activation checkpointing runs a backward inside a backward).

It ends when that backward pass ends (an autograd graph-task callback queued
from the first hook that fires in it outside any nested pass), or at the
latest at the next ``opt.step()`` / ``opt.zero_grad()`` or the first hook of
a later backward pass. Only the callback says the pass ended; the others
also close a pass that failed (autograd runs no callbacks then).

Nesting is found from the Python stack: each backward pass run from Python
on this thread has one frame of ``torch.autograd.graph._engine_run_backward``;
the outermost such frame identifies the step. Hooks that run on autograd's
device threads (no Python backward frame on their stack) belong to the pass
whose caller waits in a backward frame on its own thread, and are matched by
graph task too: a pass whose hooks run on both threads is one step. A
nested pass run from a device thread (reentrant checkpointing on an
accelerator) has a backward frame of its own there, while another thread
runs the outer pass: it is nested in that pass (_pass_of). Several threads
running backward passes at once are not told apart (not supported).
"""
import functools
import gc
import sys
import threading

import torch

try:  # torch >= 2.3 routes every Python backward call through this function
    from torch.autograd.graph import _engine_run_backward as _engine_fn
    _ENGINE_CODE = _engine_fn.__code__
except (ImportError, AttributeError):  # pragma: no cover - older torch
    _ENGINE_CODE = None


# Graph tasks whose end-of-backward callbacks began: a callback with no
# Python line (set.add through functools.partial), queued by the first
# BackwardSteps that sees the task, before any Python callback of any
# optimizer. It records the pass's end even where an interrupt stops a
# Python callback at its first line, and the engine runs no later callback
# once one raised: a record per BackwardSteps left another optimizer's
# unrecorded (a review). Pruned to the last _TASKS_KEPT task ids.
_ENDED_TASKS = set()
_MARKED_TASKS = set()
_TASKS_KEPT = 512


def _mark_task(task: int) -> None:
    """Queues the record of graph task task's end, once per task."""
    if task in _MARKED_TASKS:
        return
    if len(_MARKED_TASKS) > 2 * _TASKS_KEPT:  # (task ids only grow)
        for kept in (_MARKED_TASKS, _ENDED_TASKS):
            for t in [t for t in kept if t < task - _TASKS_KEPT]:
                kept.discard(t)
    _MARKED_TASKS.add(task)
    torch.autograd.Variable._execution_engine.queue_callback(
        functools.partial(_ENDED_TASKS.add, task))


def _in_compiled_autograd() -> bool:
    """Whether compiled autograd runs the pass (it runs no end-of-backward
    callbacks)."""
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    return ca is not None and bool(getattr(ca, "in_compiled_autograd_region", False))


def _outermost(f):
    """(the outermost backward frame of the stack from frame f or None,
    how many there are)."""
    outer, depth = None, 0
    while f is not None:
        if f.f_code is _ENGINE_CODE:
            outer, depth = f, depth + 1
        f = f.f_back
    return outer, depth


def _outer_backward():
    """(outermost backward frame on this thread or None, nesting depth)."""
    if _ENGINE_CODE is None:
        return None, 0
    return _outermost(sys._getframe(2))


def _thread_frames() -> dict:
    """sys._current_frames() with the garbage collector paused: CPython
    holds its thread-list lock while it builds the frames, and a collection
    started by that allocation which frees a threading.local takes the same
    lock again (a deadlock seen in this project's tests, CPython 3.11)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return sys._current_frames()
    finally:
        if enabled:
            gc.enable()


def _running_backward_frame(skip_thread=None):
    """The outermost backward frame of the one thread (other than
    skip_thread) running a backward pass from Python, or None (none, or
    several threads)."""
    if _ENGINE_CODE is None:
        return None
    found = None
    for tid, f in _thread_frames().items():
        if tid == skip_thread:
            continue
        outer = _outermost(f)[0]
        if outer is not None:
            if found is not None:
                return None
            found = outer
    return found


def _pass_of(frame, depth):
    """(the outermost backward frame of the pass a hook belongs to, its
    nesting depth), from the hook's own thread's (frame, depth). A hook on
    an autograd device thread has no backward frame of its own: it serves
    the pass whose caller waits in one on its own thread. A hook whose
    thread runs a backward while another thread's runs (a reentrant
    checkpoint's nested pass, started from an accelerator's device thread
    by the checkpoint's backward) is nested in that one."""
    if frame is None:
        other = _running_backward_frame()
        return (other, 1) if other is not None else (None, depth)
    if not isinstance(threading.current_thread(), threading._DummyThread):
        # A thread Python started (the main thread too) runs its own passes:
        # another thread's backward at the same time, of another model and
        # optimizer say, is not its parent (taken as one, it merged this
        # thread's passes into one step and dropped gradients as "second
        # parts"). Autograd's device threads are not Python's.
        return (frame, depth)
    other = _running_backward_frame(threading.get_ident())
    return (other, depth + 1) if other is not None else (frame, depth)


class BackwardSteps:
    """Tracks the open step and which parameters' hooks fired in it.

    on_close(ended) is called (with the lock held) each time a step ends:
    ended is True when the backward pass's end-of-backward callback closed
    it, False when something else did (step(), zero_grad(), a later
    backward pass, a failed pass that never reached its callback). The
    frame that identifies an open step is referenced until the step closes,
    so its identity cannot be reused by a later backward pass.
    """

    def __init__(self, on_close):
        self.lock = threading.RLock()
        self.fired = set()      # parameter indices whose hook fired this step
        self._open = False
        self._frame = None      # the step's outermost backward frame, if seen
        # whether the last step closed was closed by its end-of-backward
        # callback (False at first: under compiled autograd none runs)
        self.last_ended = False
        # (whether the last step's pass ended, whether its close held back
        # what it had not applied: close()), set as the close begins
        self.closed = (False, False)
        self._tasks = set()     # graph tasks seen in the open step
        self._queued = set()    # graph tasks with an end-of-backward callback
        self._on_close = on_close
        # Steps closed so far, and (graph task, that count) at this thread's
        # last enter(): the next hook of the same task while no step has
        # closed since belongs to the same step (enter's fast path). A count,
        # not the frame: a backward pass's frame holds its caller's locals (a
        # batch, a loss) alive while referenced.
        self._gen = 0
        self._last = threading.local()
        # (graph task, step count) for which can_queue said yes: asked at
        # every hook, it answers the same until the step closes (0.3 us a
        # hook saved)
        self._can_queue = None

    @property
    def is_open(self) -> bool:
        return self._open

    def enter(self) -> int:
        """Called first thing in every hook: opens (or continues) a step;
        returns the graph task's id (-1 outside one).

        A hook continues the open step when its outermost backward frame is
        the step's, or its graph task is one the step has seen (a hook on
        an autograd device thread, which has no backward frame, in the same
        pass as hooks on the calling thread). A hook of the graph task whose
        hook this thread saw last, while that step is still open, continues
        it without walking the stack (about 1 us a hook, more under a deep
        stack): only the first hook of each task walks it."""
        task = torch._C._current_graph_task_id()
        last = self._last
        with self.lock:
            if (task >= 0 and self._open and getattr(last, "task", None) == task
                    and last.gen == self._gen):
                return task
        frame, depth = _pass_of(*_outer_backward())
        with self.lock:
            if self._open and not ((frame is not None and frame is self._frame)
                                   or (task >= 0 and task in self._tasks)):
                # (a new pass runs: nothing of the old one is applied now,
                # even if its end was recorded: it would change weights this
                # pass still needs, and autograd's version check failed it;
                # a review)
                self._close_locked(recorded=True, hold=True)
            if not self._open:
                # a new step: its frame (one left by a close an interrupt
                # cut short took a reentrant checkpoint's inner pass for a
                # new one; a review)
                self._frame = frame
            elif frame is not None and self._frame is None:
                self._frame = frame
            self._open = True
            if task >= 0:
                self._tasks.add(task)
            # Only the outermost pass may end the step: a nested (reentrant)
            # pass ends while its outer pass still has gradients to deliver.
            if depth <= 1 and task >= 0 and task not in self._queued:
                self._queued.add(task)
                # (first the record of the task's end: step()'s close then
                # knows the pass ended where an interrupt stopped the
                # callback; taken as failed, its queued updates were dropped.
                # Not under compiled autograd, which runs no callbacks and
                # whose tracing of this function refuses the call)
                if not _in_compiled_autograd():
                    _mark_task(task)
                torch.autograd.Variable._execution_engine.queue_callback(
                    lambda gen=self._gen: self._end_of_backward(gen))
            last.task, last.gen = task, self._gen
        return task

    def _end_of_backward(self, gen: int) -> None:
        """A callback queued in step gen: its backward pass ended."""
        with self.lock:
            if self._open and self._gen == gen:
                self._close_locked(ended=True)

    def can_queue(self, task: int) -> bool:
        """Whether an update may wait for the end of the backward pass of
        graph task task: the task will close the step by its callback (not
        a nested pass), the last step was closed by its callback, the step's
        backward frame is known (pass_running can judge it), and compiled
        autograd, which runs no such callbacks, is not running the pass."""
        if self._can_queue == (task, self._gen):
            return True  # (a yes stays a yes until the step closes: kept)
        if not (self.last_ended and task in self._queued and self._frame is not None):
            return False
        if _in_compiled_autograd():
            return False
        self._can_queue = (task, self._gen)
        return True

    def pass_running(self) -> bool:
        """For on_close: whether the closing step's outermost backward pass
        is still running (its frame on a thread's stack): False once it has
        returned or raised."""
        frame = self._frame
        if frame is None:
            return False
        for f in _thread_frames().values():
            while f is not None:
                if f is frame:
                    return True
                f = f.f_back
        return False

    @property
    def gen(self) -> int:
        """The number of steps closed so far."""
        return self._gen

    def close(self, recorded: bool = False, hold: bool = False) -> None:
        """Ends the open step, if any, from outside backward (step(),
        zero_grad(), load_state_dict(), remove_hooks()); with recorded
        (step(), zero_grad(), load_state_dict()), a pass whose end was
        recorded (_ENDED_TASKS) counts as ended; with hold (zero_grad(),
        load_state_dict(), and the first hook of a new pass), a pass whose
        end was recorded, which an interrupt cut short, or an outermost
        pass that raised has nothing applied now (closed[1]: the optimizer
        keeps what it had not applied for step(); a load drops it)."""
        with self.lock:
            if self._open:
                self._close_locked(recorded=recorded, hold=hold)

    def _close_locked(self, ended: bool = False, recorded: bool = True,
                      hold: bool = False) -> None:
        # (in this order, the step closed in one statement: an interrupt
        # before it leaves the step open and its end recorded, for the next
        # close; closed says how it closed, for the optimizer's retry)
        ended = ended or (recorded and not self._tasks.isdisjoint(_ENDED_TASKS))
        # held back also after an outermost pass that raised (its end's
        # record queued, never run, its frame gone): the window's flush
        # there changed weights the next pass, or a forward since, still
        # needed, and autograd's version check failed it (known since the
        # eighteenth session; forty-second). Not for compiled autograd's
        # passes (no record queued) nor steps of nested passes alone (none
        # outermost): closed by the next hook or zero_grad(), as before.
        hold = hold and (ended or (not self._queued.isdisjoint(_MARKED_TASKS)
                                   and not self.pass_running()))
        self._gen, self._open, self.closed, self._tasks, self._queued, self.fired = (
            self._gen + 1, False, (ended, hold), set(), set(), set())  # (stores on one line)
        try:
            self._on_close(ended)
        finally:
            self._frame = None
            self.last_ended = ended
