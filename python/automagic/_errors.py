"""The front end's exceptions (automagic.AutomagicError,
automagic.NonFiniteGradientError)."""


class AutomagicError(RuntimeError):
    """Raised when libautomagic refuses an update (the message says why)."""


class NonFiniteGradientError(AutomagicError):
    """nonfinite="raise" and a gradient (or its update) was not finite.

    The parameter and its state are unchanged; p.grad is left in place."""
