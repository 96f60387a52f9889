"""Run ``torchrun`` from a notebook cell or a script: live output, a timeout, a clear failure.

Multi-process code lives in the package; a notebook starts it with :func:`torchrun`, which
streams every line into the cell as it arrives, kills the whole process tree when the timeout
passes (never a hang), turns a crash into a one-line summary naming the failing rank, and
returns the metrics the workers wrote as JSON lines.
"""

from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .jsonl import read_jsonl

_PREFIX = re.compile(r"^\[default(\d+)\]:(.*)$")
# torchrun's --tee, reading a rank's log while it is written, can tag a line mid-way too.
_TEE_TAG = re.compile(r"\[default\d+\]:")
_RANK_TAG = re.compile(r"^\s*\[rank\d+\]:")  # torch tags lines once a process group exists
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b.*")
# A C++ exception that ends the process (NCCL's watchdog after a timeout): std::terminate
# names its type on one line and its message on the next.
_CXX_TYPE = re.compile(r"^terminate called after throwing an instance of '([^']+)'")
_CXX_WHAT = re.compile(r"^what\(\):\s*(.+)")


class LaunchError(RuntimeError):
    """A launched job failed or timed out; ``str()`` is a one-line summary."""

    def __init__(self, summary: str, output: str) -> None:
        super().__init__(summary)
        self.output = output


@dataclass
class LaunchResult:
    returncode: int
    output: str
    metrics: list[dict] = field(default_factory=list)


def failure_summary(output: str, returncode: int) -> str:
    """One line: which rank failed first, and with which exception (Python's or C++'s)."""
    root = output.rsplit("Root Cause", 1)
    match = re.search(r"local_rank:\s*(\d+)", root[1]) if len(root) == 2 else None
    rank = match.group(1) if match else None
    last_error = cxx_type = cxx_error = None
    for line in output.splitlines():
        prefixed = _PREFIX.match(line)
        if prefixed and (rank is None or prefixed.group(1) == rank):
            text = _RANK_TAG.sub("", _TEE_TAG.sub("", prefixed.group(2))).strip()
            if _EXCEPTION.match(text):
                last_error, rank = text, prefixed.group(1)
            elif found := _CXX_TYPE.match(text):
                cxx_type = found.group(1)
            elif cxx_type and (found := _CXX_WHAT.match(text)):
                cxx_error, rank = f"{cxx_type}: {found.group(1)}", prefixed.group(1)
    who = f"rank {rank}" if rank is not None else "the job"
    what = last_error or cxx_error or f"exit code {returncode}"
    return f"{who} failed: {what} (full output above)"


def _stream(proc: subprocess.Popen, deadline: float, echo: bool) -> tuple[list[str], bool]:
    lines: list[str] = []
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return lines, True
        if not sel.select(timeout=min(remaining, 1.0)):
            continue
        line = proc.stdout.readline()
        if not line:  # EOF: every process holding the pipe has exited
            return lines, False
        lines.append(line.rstrip("\n"))
        if echo:
            print(lines[-1], flush=True)


def kill_tree(proc: subprocess.Popen) -> None:
    """Stop a process started with ``start_new_session=True`` and all its children."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def torchrun(
    target: str,
    args: Sequence[str] = (),
    *,
    nproc: int = 1,
    timeout_s: float = 600.0,
    metrics_file: Path | None = None,
    torchrun_args: Sequence[str] = ("--standalone",),
    env: dict[str, str] | None = None,
    echo: bool = True,
) -> LaunchResult:
    """Run ``torchrun --nproc_per_node=nproc -m target *args``; raise LaunchError on failure.

    ``target`` is a module (``tutorial_utils.train``) or a path ending in ``.py``. The
    environment is inherited (plus ``env``); a stale ``metrics_file`` is removed first.
    """
    if metrics_file is not None:
        metrics_file.unlink(missing_ok=True)
    program = [target] if target.endswith(".py") else ["-m", target]
    cmd = [
        sys.executable, "-m", "torch.distributed.run", *torchrun_args,
        f"--nproc_per_node={nproc}", "--tee=3", *program, *args,
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        start_new_session=True,  # its own process group, so a timeout can kill every worker
    )
    try:
        lines, timed_out = _stream(proc, time.monotonic() + timeout_s, echo)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    proc.wait()
    output = "\n".join(lines)
    if timed_out:
        raise LaunchError(f"timed out after {timeout_s:.0f} s; all processes were killed", output)
    if proc.returncode != 0:
        raise LaunchError(failure_summary(output, proc.returncode), output)
    metrics = read_jsonl(metrics_file) if metrics_file is not None else []
    return LaunchResult(proc.returncode, output, metrics)
