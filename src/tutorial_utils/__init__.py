"""Shared code of the book *Training one network on several GPUs with PyTorch*.

Kept light on purpose: importing the package imports no submodule, so a notebook pulls in
only what it uses (and the stale-output check hashes only that).
"""

import os as _os

__version__ = "0.1.0"

# Set by `nbtools execute` for a notebook's kernel, so every process the notebook starts
# (torchrun's workers, `python -m tutorial_utils.train`) inherits it: the stale check then
# covers the code that made an output, not only what the kernel imported.
_MODULE_LOG = _os.environ.get("TUTORIAL_MODULE_LOG")


def _log_modules(names=None) -> None:
    """Append package module names (default: all this process imported) to the module log."""
    if not _MODULE_LOG:
        return
    import json
    import sys

    if names is None:
        names = list(sys.modules)
        # `python -m tutorial_utils.train` runs train.py as __main__, under no other name.
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        if spec is not None:
            names.append(spec.name)
    mine = sorted({n for n in names if n.split(".")[0] == __name__})
    try:
        # Append mode, one write per line: many processes share the file at once.
        with open(_MODULE_LOG, "a") as f:
            f.write(json.dumps(mine) + "\n")
    except OSError:
        pass  # the log must never break a process's exit


if _MODULE_LOG:
    import atexit as _atexit

    # At exit, so the list holds everything the process imported. A process killed by a
    # signal (SIGKILL, NCCL's watchdog abort) writes nothing; the others, and a restarted
    # attempt, still do, and `launch.torchrun` logs its target before it starts the job.
    _atexit.register(_log_modules)
