"""A KeyboardInterrupt at the k-th line the automagic package runs: the
interrupt-at-every-line tests (test_frontend_interrupt,
test_frontend_unhooked) call a front-end method under it for every k until
it no longer fires. The tracer raises where Python itself would not check
for signals (between two stores, say): a stricter test than Ctrl-C.
_bad_lines runs such a test over every line, comparing each run's result
(_snapshot: parameters and state) with the uninterrupted run's."""
import os
import sys

import torch

import automagic

_PKG = os.path.dirname(automagic.__file__)


class LineInterrupt:
    """run(fn): fn() under a tracer that raises KeyboardInterrupt at the
    k-th line of the package (k = 0: no tracer); fired: whether it did.
    after (a function of the package): lines are counted from its first
    call on."""

    def __init__(self, k: int, after=None):
        self.k, self.n, self.fired = k, 0, False
        self.after, self.armed = (None, True) if after is None else (after.__code__, False)

    def _line(self, frame, event, arg):
        if event == "line" and not self.fired and self.armed:
            self.n += 1
            if self.n == self.k:
                self.fired = True
                raise KeyboardInterrupt
        return self._line

    def _call(self, frame, event, arg):
        if frame.f_code is self.after:
            self.armed = True
        return self._line if frame.f_code.co_filename.startswith(_PKG) else None

    def run(self, fn) -> None:
        if not self.k:
            return
        sys.settrace(self._call)
        try:
            fn()
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)


def _snapshot(opt, ps) -> list:
    """ps and every state tensor of theirs, copied (steps as tensors)."""
    out = [p.detach().clone() for p in ps]
    for p in ps:
        out += [v if isinstance(v, torch.Tensor) else torch.tensor(v)
                for _, v in sorted(opt.state[p].items())]
    return out


def _same(ref, got) -> bool:
    return all(torch.equal(x, y) for x, y in zip(ref, got))


def _bad_lines(run, good=_same):
    """run(k) -> (result, whether the interrupt at line k fired): (the
    first k that did not fire, the bad k: those whose result is not
    good(run(0)'s, it), and those whose run raised RuntimeError, as
    autograd's in-place error, with its message)."""
    ref, _ = run(0)
    k, bad = 1, []
    while True:
        try:
            got, fired = run(k)
        except RuntimeError as e:
            bad.append((k, str(e)[:40]))
            k += 1
            continue
        if not fired:
            return k, bad
        if not good(ref, got):
            bad.append(k)
        k += 1
