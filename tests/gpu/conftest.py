"""Everything under tests/gpu needs CUDA: skipped (not failed) on CPU-only machines."""

from pathlib import Path

import pytest
import torch

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if _HERE in Path(item.path).parents:
            item.add_marker(skip)
