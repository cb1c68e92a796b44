"""The front end's exceptions (automagic.AutomagicError,
automagic.NonFiniteGradientError), and where its warnings point."""
import os
import sys

import torch


class AutomagicError(RuntimeError):
    """Raised when libautomagic refuses an update (the message says why)."""


class NonFiniteGradientError(AutomagicError):
    """nonfinite="raise" and a gradient (or its update) was not finite.

    The parameter and its state are unchanged; p.grad is left in place."""


_OWN_DIRS = (os.path.dirname(os.path.abspath(__file__)) + os.sep,
             os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)


def caller_level() -> int:
    """The stacklevel of warnings.warn, called by the caller of this
    function, that names the first frame outside this package and torch:
    the user's line (a fixed level named torch's no_grad wrapper or this
    package's own code; found by a review, thirty-third session)."""
    f, level = sys._getframe(1), 1
    while f is not None and f.f_code.co_filename.startswith(_OWN_DIRS):
        f, level = f.f_back, level + 1
    return level
