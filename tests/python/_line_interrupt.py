"""A KeyboardInterrupt at the k-th line the automagic package runs: the
interrupt-at-every-line tests (test_frontend_interrupt,
test_frontend_unhooked) call a front-end method under it for every k until
it no longer fires. The tracer raises where Python itself would not check
for signals (between two stores, say): a stricter test than Ctrl-C."""
import os
import sys

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
