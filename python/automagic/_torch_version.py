"""The oldest torch release the front end supports, checked at import."""
import re

# torch 2.4.1 failed 22 of the Python tests: its increment_version takes no
# list (step() raised after updating), its compiled autograd has no
# in_compiled_autograd_region, its optimizers take no named parameters.
# 2.6.0 is the oldest release the suite passes on (scripts/test.sh runs it).
MIN_TORCH = (2, 6)


def check(version: str) -> None:
    """Raises ImportError naming both releases when torch's version string
    (torch.__version__: "2.6.0", "2.13.0+cpu", "2.7.0a0+git...") is older
    than MIN_TORCH; a string without a release number is let through."""
    m = re.match(r"(\d+)\.(\d+)", str(version))
    if m and (int(m.group(1)), int(m.group(2))) < MIN_TORCH:
        raise ImportError("automagic needs torch %d.%d or newer; this is torch %s "
                          "(pip install 'torch>=%d.%d')" % (MIN_TORCH + (version,) + MIN_TORCH))
