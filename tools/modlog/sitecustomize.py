"""Log every ``tutorial_utils`` module this process imports, for the book's stale-output check.

``tools/nbtools.py execute`` runs a notebook's kernel with this folder on ``PYTHONPATH`` and a
log file named in ``TUTORIAL_MODULE_LOG``; the kernel and every process it starts (torchrun,
its workers, ``python -m tutorial_utils.train``) inherit both, so each imports this module as
it starts. Each module is logged when it is imported, not at exit, so a process ended by a
signal (a crash the book makes on purpose, NCCL's watchdog) has logged what it ran too.
Without ``TUTORIAL_MODULE_LOG`` this module does nothing.
"""

import json
import os
import sys

_LOG = os.environ.get("TUTORIAL_MODULE_LOG")
_PACKAGE = "tutorial_utils"


def _write(names: list[str]) -> None:
    try:  # append mode, one write per line: many processes share the file
        with open(_LOG, "a") as f:
            f.write(json.dumps(names) + "\n")
    except OSError:
        pass  # the log must never break the process it watches


def _on_import(event: str, args: tuple) -> None:
    if event == "import" and isinstance(args[0], str) and args[0].split(".")[0] == _PACKAGE:
        _write([args[0]])


if _LOG:
    # `python -m tutorial_utils.x` runs x without an import event, and so does torchrun's
    # worker, whose launcher's command line names it: log the program itself first.
    argv = getattr(sys, "orig_argv", sys.argv)
    after_m = [b for a, b in zip(argv, argv[1:], strict=False) if a == "-m"]
    if programs := [name for name in after_m if name.split(".")[0] == _PACKAGE]:
        _write(programs)
    sys.addaudithook(_on_import)
