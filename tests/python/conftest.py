"""Shared fixtures for the Python tests.

``reference`` loads the original PyTorch class from
``<repo root>/../shared/reference/automagic3.py`` (the file the project was
created from; it is not part of this repository) and skips the test with a
message saying where it looked when the file is absent (a failure instead
where ``AM_REQUIRE_REFERENCE=1``, as CI sets it).

``make_reference`` builds a reference optimizer with its stdout silenced: the
reference prints a parameter count (and a warning for a high lr) on
construction, which would only clutter the test output.

``measured`` is a session-wide record of the largest errors (and smallest
margins) the reference comparisons saw; they are printed at the end of the run so that a report can
quote measured figures instead of the tolerances.
"""
import contextlib
import importlib.util
import io
import os
import pathlib

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
REFERENCE_PATH = REPO_ROOT.parent / "shared" / "reference" / "automagic3.py"

# name -> (largest value seen, where it was seen)
_MEASURED = {}


class Measured:
    """Keeps the largest (or, with smallest=True, the smallest) value of each
    named figure over the session."""

    def record(self, name: str, value: float, where: str, smallest: bool = False) -> None:
        value = float(value)
        if name not in _MEASURED:
            _MEASURED[name] = (value, where)
        old = _MEASURED[name][0]
        if (value < old) if smallest else (value > old):
            _MEASURED[name] = (value, where)


@pytest.fixture(scope="session")
def measured() -> Measured:
    return Measured()


@pytest.fixture(scope="session")
def reference():
    """The reference ``Automagic3`` class (module-level, imported once)."""
    if not REFERENCE_PATH.is_file():
        if os.environ.get("AM_REQUIRE_REFERENCE") == "1":
            # CI has ../shared: a missing reference there must fail the run,
            # not turn every comparison into a skip
            pytest.fail("AM_REQUIRE_REFERENCE=1 but the reference implementation is "
                        "not at %s" % REFERENCE_PATH, pytrace=False)
        pytest.skip("reference implementation not found at %s (these tests compare "
                    "against ../shared/reference/automagic3.py beside the repository)"
                    % REFERENCE_PATH)
    spec = importlib.util.spec_from_file_location("automagic3_reference", REFERENCE_PATH)
    module = importlib.util.module_from_spec(spec)
    with contextlib.redirect_stdout(io.StringIO()):
        spec.loader.exec_module(module)
    return module.Automagic3


@pytest.fixture(scope="session")
def make_reference(reference):
    """make_reference(params, **hyperparameters) -> reference optimizer, silently."""
    def make(params, **kwargs):
        with contextlib.redirect_stdout(io.StringIO()):
            return reference(params, **kwargs)
    return make


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _MEASURED:
        return
    terminalreporter.section("automagic vs reference: figures measured")
    for name in sorted(_MEASURED):
        value, where = _MEASURED[name]
        terminalreporter.write_line("%-48s %.3e   (%s)" % (name, value, where))
