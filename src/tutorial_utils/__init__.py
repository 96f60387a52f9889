"""Shared code of the book *Training one network on several GPUs with PyTorch*.

Kept light on purpose: importing the package imports no submodule, so a notebook pulls in
only what it uses (and the stale-output check hashes only that).
"""

__version__ = "0.1.0"
