import pytest
import torch

pytestmark = pytest.mark.gpu


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/gpu" in str(item.fspath):
            item.add_marker(pytest.mark.gpu)
