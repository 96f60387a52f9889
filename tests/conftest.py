import sys
from pathlib import Path

import pytest
import torch

# The book's tooling (tools/nbtools.py) is not part of the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))


def pytest_collection_modifyitems(config, items):
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "gpu" in item.keywords and n_gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "multigpu" in item.keywords and n_gpus < 2:
            item.add_marker(pytest.mark.skip(reason="needs two CUDA GPUs"))


@pytest.fixture
def syncs(monkeypatch):
    """The (call, inode) of every os.fsync and os.replace made during the test, in order."""
    import os

    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.fstat(fd).st_ino))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.stat(src).st_ino))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return events
