"""Run ``torchrun`` from a notebook cell or a script: live output, a timeout, a clear failure.

Multi-process code lives in the package; a notebook starts it with :func:`torchrun`, which
streams every line into the cell as it arrives, kills the whole process tree when the timeout
passes (never a hang), turns a crash into a one-line summary naming the failing rank, and
returns the metrics the workers wrote as JSON lines.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import selectors
import signal
import subprocess
import sys
import tempfile
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
# A program's own one-line error, as the package's programs end on a bad setting or file.
_CLI_ERROR = re.compile(r"^(python -m )?[\w./-]+: error: .+")
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


def failure_summary(output: str, returncode: int, echoed: bool = True) -> str:
    """One line: which rank failed first, and with which exception (Python's or C++'s) or
    which error message; ``echoed``: whether the output was shown as it came."""
    root = output.rsplit("Root Cause", 1)
    match = re.search(r"local_rank:\s*(\d+)", root[1]) if len(root) == 2 else None
    rank = match.group(1) if match else None
    last_error = cxx_type = cxx_error = None
    for line in output.splitlines():
        prefixed = _PREFIX.match(line)
        if prefixed and (rank is None or prefixed.group(1) == rank):
            text = _RANK_TAG.sub("", _TEE_TAG.sub("", prefixed.group(2))).strip()
            if _EXCEPTION.match(text) or _CLI_ERROR.match(text):
                last_error, rank = text, prefixed.group(1)
            elif found := _CXX_TYPE.match(text):
                cxx_type = found.group(1)
            elif cxx_type and (found := _CXX_WHAT.match(text)):
                cxx_error, rank = f"{cxx_type}: {found.group(1)}", prefixed.group(1)
    who = f"rank {rank}" if rank is not None else "the job"
    what = last_error or cxx_error or f"exit code {returncode}"
    where = "full output above" if echoed else "its full output is the error's .output"
    return f"{who} failed: {what} ({where})"


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


KILL_GRACE_S = 10.0  # how long a timed-out job has to stop on SIGTERM before SIGKILL


def descendants(pid: int) -> dict[int, int]:
    """Every process below ``pid``, with its start time, read from Linux's /proc (none found
    elsewhere). A pid names one process only while it runs: once it exits, the kernel may give
    the number to another; the start time tells the two apart."""
    children: dict[int, list[tuple[int, int]]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:  # "pid (name) state ppid ...": the name may hold spaces and brackets
            fields = stat.read_text().rsplit(")", 1)[1].split()
            ppid, started = int(fields[1]), int(fields[19])  # fields 4 and 22 of stat(5)
        except (OSError, IndexError, ValueError):
            continue  # it exited while we looked
        children.setdefault(ppid, []).append((int(stat.parent.name), started))
    found: dict[int, int] = {}
    todo = [pid]
    while todo:
        for child, started in children.get(todo.pop(), []):
            found[child] = started
            todo.append(child)
    return found


def _start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot, field 22 of /proc/<pid>/stat); None if no
    process has that pid."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def kill_tree(proc: subprocess.Popen, grace_s: float | None = None) -> None:
    """Stop a process started with ``start_new_session=True`` and every process below it.

    SIGTERM to its process group first, which lets torchrun pass it on to its workers; then,
    after ``grace_s``, SIGKILL to the group and to each descendant still running. torchrun
    starts every worker in a session of its own, out of reach of a signal to torchrun's group,
    and a worker that ignores SIGTERM (blocked in a collective, or saving a checkpoint on
    SIGTERM) would outlive torchrun. The descendants are listed while the job runs: once their
    parent is killed they belong to init, and nothing links them to this job any more.
    """
    job = descendants(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + (KILL_GRACE_S if grace_s is None else grace_s)
    while time.monotonic() < deadline and (proc.poll() is None or _running(job)):
        job |= descendants(proc.pid)
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in _running(job):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def _running(job: dict[int, int]) -> set[int]:
    """The processes of ``job`` ({pid: start time}) still running: not exited, and not
    replaced by a later process that was given the same pid (that one is not the job's)."""
    alive = set(job) - _gone(set(job))
    return {pid for pid in alive if _start_time(pid) == job[pid]}


def _gone(pids: set[int]) -> set[int]:
    """The processes of ``pids`` that have exited (a zombie counts as exited)."""
    gone = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            state = "Z"
        if state in ("Z", "X"):
            gone.add(pid)
    return gone


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
        raise LaunchError(failure_summary(output, proc.returncode, echo), output)
    metrics = read_jsonl(metrics_file) if metrics_file is not None else []
    return LaunchResult(proc.returncode, output, metrics)


def run_worker(module: str, cfg, *, nproc: int, timeout_s: float = 900.0,
               env: dict[str, str] | None = None, row_type: type | None = None) -> list:
    """The rows the worker ``module`` wrote, run with ``cfg`` in ``nproc`` processes under
    torchrun, its ``out`` a temporary file; each row as ``row_type`` (a dataclass) if given."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = dataclasses.replace(cfg, out=Path(tmp) / "rows.jsonl")
        rows = torchrun(module, cfg.to_argv(), nproc=nproc, timeout_s=timeout_s,
                        metrics_file=cfg.out, env=env, echo=False).metrics
    return [row_type(**r) for r in rows] if row_type else rows
