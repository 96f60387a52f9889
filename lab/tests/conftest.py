"""The lab's workers import ``lab``: put the repository root on the path of every process.
GPU tests skip without GPUs as in the package's own tests (the same hook)."""

import os
import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
sys.path.insert(0, ROOT)

from tests.conftest import pytest_collection_modifyitems  # noqa: E402, F401
