"""Everything under tests/gpu needs CUDA: skipped (not failed) on CPU-only machines.

With PDSERVE_GPU_RESULTS=<file>, each test's outcome is appended to it as one JSON line the moment
the test ends (flushed), so a run killed by the GPU check's deadline still says what passed and what
failed; pytest's --junitxml is only written at the end of the session.
"""

import json
import os
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


def pytest_runtest_logreport(report):
    path = os.environ.get("PDSERVE_GPU_RESULTS")
    # One line per test: its call phase, or the setup phase when that failed or skipped it.
    if not path or not (report.when == "call" or (report.when == "setup" and report.outcome != "passed")):
        return
    line = {"test": report.nodeid, "outcome": report.outcome, "seconds": round(report.duration, 3)}
    if report.failed:
        line["error"] = str(report.longrepr)[-1500:]
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")
