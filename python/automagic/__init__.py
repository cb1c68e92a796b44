"""automagic: the Automagic3 optimizer, computed by libautomagic (C).

``automagic.Automagic3`` is a drop-in replacement for the reference PyTorch
class, with the differences listed in the project README.
"""
from ._lib import version as _version
from .optim import Automagic3, AutomagicError

__version__ = _version()
__all__ = ["Automagic3", "AutomagicError", "__version__"]
