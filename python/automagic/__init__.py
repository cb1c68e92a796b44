"""automagic: the Automagic3 optimizer, computed by libautomagic (C).

``automagic.Automagic3`` is a drop-in replacement for the reference PyTorch
class, with the differences listed in the project README.
"""
from ._lib import version as _version
from ._checkpoint import CheckpointError
from .optim import Automagic3, AutomagicError, NonFiniteGradientError

__version__ = _version()
__all__ = ["Automagic3", "AutomagicError", "NonFiniteGradientError", "CheckpointError",
           "__version__"]
