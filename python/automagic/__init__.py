"""automagic: the Automagic3 optimizer, computed by libautomagic (C).

``automagic.Automagic3`` is a drop-in replacement for the reference PyTorch
class, with the differences listed in the project README.
"""
import torch as _torch

from . import _torch_version

_torch_version.check(_torch.__version__)

from . import _lib  # noqa: E402 (after the torch check)
from ._checkpoint import CheckpointError  # noqa: E402
from .optim import Automagic3, AutomagicError, NonFiniteGradientError  # noqa: E402

__version__ = _lib.version()
# The kernels chosen now (they are chosen once, at the library's first
# use), so that a warning about the environment variables that choose them
# (AUTOMAGIC_TUNING, AUTOMAGIC_PAR_MIN_BYTES) comes at the import
_lib.kernel_name()
_lib.flush_warnings()
__all__ = ["Automagic3", "AutomagicError", "NonFiniteGradientError", "CheckpointError",
           "__version__"]
