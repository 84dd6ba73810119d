import os

import pytest
import torch

from hasten.observability import reset_fallbacks
from hasten.ops import is_loaded

# Many tests call torch.ops.hasten.* directly, some at collection; the package loads hasten._C on
# first use only (tests/test_import.py checks, in fresh interpreters, that import loads nothing).
is_loaded()  # loads it (a broken build shows in tests/test_import.py and the ops' own tests)


def pytest_collection_modifyitems(config, items):
    # Everything under tests/gpu needs CUDA: marked `gpu`, and skipped where there is none.
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run tests/gpu on the GPU machine)")
    for item in items:
        if item.path.parent.name == "gpu" and item.path.parent.parent.name == "tests":
            item.add_marker(pytest.mark.gpu)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_fallbacks():
    reset_fallbacks()
    yield


def pytest_runtest_logreport(report):
    # HASTEN_TEST_FAILURES=<file>: each failure's traceback appended as it happens, so a device run
    # cut off by its time limit still says why a test failed (pytest prints them only at the end;
    # at 5b235b3 a timed-out call left bitnet's failure as one 'F').
    path = os.environ.get("HASTEN_TEST_FAILURES")
    if path and report.failed:
        with open(path, "a") as out:
            out.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n")
