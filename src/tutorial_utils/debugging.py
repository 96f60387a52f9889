"""Looking into a job that is stuck: which rank is where, and which one never joined.

A hung collective shows up as every rank waiting, and the log says nothing (until the process
group's timeout, chapter 6). Two views say more:

- a stack dump of each live rank, from outside the job: :func:`worker_ranks` finds torchrun's
  workers and their ranks (from their environment, on Linux), and :func:`stack_dump` runs
  ``py-spy dump`` on one of them. py-spy reads a running Python process's stack without
  stopping it or needing any code inside it (it needs permission to trace the process: the
  same user, and ptrace allowed, which some containers forbid);
- PyTorch's flight recorder, from inside: with ``TORCH_FR_BUFFER_SIZE=N`` every process group
  keeps its last N collectives (operation, sequence number, shapes, state, Python stack) in a
  ring buffer. :func:`write_flight_record` writes a rank's buffer to a file, and
  :func:`never_joined` runs PyTorch's analyser (``torch.distributed.flight_recorder``) on the
  files of all ranks, which names the collective that not every rank entered.

And one view of a job that runs, but slower than it should: NCCL's own log
(``NCCL_DEBUG=INFO``) says, for each pair of ranks, which transport it chose (``P2P`` between
GPUs, ``SHM`` through host memory, ``NET/...`` over a network) and on how many channels;
:func:`nccl_links` reads that out of the log.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .launch import descendants

ANSI_COLOUR = re.compile(r"\x1b\[[0-9;]*m")  # a terminal's colour codes


def worker_ranks(torchrun_pid: int) -> dict[int, int]:
    """{rank: pid} of the workers below a torchrun process, read from their ``RANK``."""
    ranks = {}
    for pid in descendants(torchrun_pid):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:  # exited, or not ours to read
            continue
        rank = next((v[5:] for v in env if v.startswith(b"RANK=")), None)
        if rank is not None and b"TORCHELASTIC_RUN_ID=" in b"\0".join(env):
            ranks.setdefault(int(rank), pid)  # the worker, not a helper it started
    return ranks


def py_spy() -> str | None:
    """py-spy's program: on the PATH, beside this Python (a virtual environment that is not
    activated), or in the ``bin`` folder of a ``pip install --target`` folder on sys.path."""
    places = [None, str(Path(sys.executable).parent),
              *(str(Path(p) / "bin") for p in sys.path if p)]
    return next((exe for place in places if (exe := shutil.which("py-spy", path=place))), None)


def stack_dump(pid: int, timeout_s: float = 30.0) -> str:
    """The Python stack of every thread of ``pid``, innermost frame first (``py-spy dump``)."""
    exe = py_spy()
    if exe is None:
        raise FileNotFoundError("py-spy is not installed: pip install py-spy")
    done = subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True, text=True,
                          timeout=timeout_s, env=os.environ | {"NO_COLOR": "1"})
    if done.returncode != 0:
        last = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:] or ["no output"]
        raise PermissionError(f"py-spy could not read process {pid}: {last[0]}")
    return ANSI_COLOUR.sub("", done.stdout)  # some py-spy builds colour even into a pipe


def main_thread(dump: str, frames: int = 3) -> list[str]:
    """The innermost ``frames`` frames of the main thread in a ``py-spy dump``."""
    lines = dump.splitlines()
    start = next((i for i, line in enumerate(lines) if '"MainThread"' in line), None)
    if start is None:
        return []
    out = []
    for line in lines[start + 1:]:
        if not line.startswith("    "):
            break
        out.append(line.strip())
    return out[:frames]


def starting(dump: str) -> bool:
    """Whether the main thread of a ``py-spy dump`` is inside an import: a process that is
    still starting (a large module can take seconds to compile), not one that is stuck."""
    return any("<frozen importlib" in frame for frame in main_thread(dump, frames=10_000))


def stuck_stacks(torchrun_pid: int, frames: int = 3, wait_s: float = 60.0,
                 every_s: float = 1.0) -> dict[int, list[str]]:
    """{rank: innermost ``frames`` frames of its main thread}, once two rounds of dumps
    ``every_s`` apart agree for every rank and no rank is still importing: a job that is
    stuck, not one that is busy or starting."""
    deadline, last = time.monotonic() + wait_s, None
    while time.monotonic() < deadline:
        dumps = {rank: stack_dump(pid) for rank, pid in sorted(worker_ranks(torchrun_pid).items())}
        now = {rank: main_thread(dump, frames) for rank, dump in dumps.items()}
        if now and now == last and all(now.values()) and not any(map(starting, dumps.values())):
            return now
        last = now
        time.sleep(every_s)
    raise TimeoutError(f"the ranks of torchrun {torchrun_pid} did not stand still for "
                       f"{every_s:.0f} s within {wait_s:.0f} s: busy, not stuck, or not started")


def write_flight_record(folder: str | Path, rank: int) -> Path:
    """Write this rank's flight record to ``folder/rank_<rank>`` (the analyser's file names)."""
    if not int(os.environ.get("TORCH_FR_BUFFER_SIZE", "0") or 0):
        raise RuntimeError("the flight recorder is off: set TORCH_FR_BUFFER_SIZE=2000 (entries "
                           "kept per process) in the job's environment")
    import torch.distributed as dist
    from torch._C import _distributed_c10d as c10d

    if not dist.is_initialized():
        raise RuntimeError("write_flight_record needs the process group still alive")
    dump = getattr(c10d, "_dump_fr_trace", None)  # every backend's record, torch >= 2.9
    if dump is None:
        raise RuntimeError(f"torch {__import__('torch').__version__} cannot write gloo's "
                           "flight record; use torch 2.9 or later")
    path = Path(folder) / f"rank_{rank}"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(dump(True, True, False))  # collectives, their stacks, not only finished
    tmp.replace(path)
    return path


def _rewrite(folder: Path, change: Callable[[dict], None]) -> None:
    """Apply ``change`` to every rank's record in ``folder`` and write it back."""
    for path in folder.glob("rank_*"):
        record = pickle.loads(path.read_bytes())
        change(record)
        path.write_bytes(pickle.dumps(record))


def _name_groups(record: dict) -> None:
    """gloo's record lists the default group under the name "" while its entries say "0" (torch
    2.11-2.14); the analyser matches the two, so name each group as its entries do."""
    named = {e["process_group"][0]: e["process_group"][1] for e in record["entries"]}
    config = record.get("pg_config", {})
    if "" in config and len(named) == 1 and "" not in named:
        (name, desc), = named.items()
        config[name] = config.pop("") | {"name": name, "desc": desc}


def _as_nccl(record: dict) -> None:
    """Relabel gloo's entries ("gloo:all_reduce") as NCCL's, for an analyser that reads only
    NCCL's (torch 2.11's); the operations, ranks and stacks it matches stay as recorded."""
    for entry in record["entries"]:
        backend, _, op = entry["profiling_name"].partition(":")
        if backend == "gloo":
            entry["profiling_name"] = f"nccl:{op}"


def _analyse(folder: Path, timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace",
                           str(folder), "--prefix", "rank_"], capture_output=True, text=True,
                          timeout=timeout_s)


def never_joined(folder: str | Path, timeout_s: float = 60.0) -> str:
    """PyTorch's analysis of the flight records in ``folder``: the collectives that not every
    rank entered, which ranks are missing, and where the others called it. The records are
    read, not changed: the analysis works on a copy."""
    folder = Path(folder)
    if not any(folder.glob("rank_*")):
        raise FileNotFoundError(f"no flight records (rank_<r>) in {folder}")
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp)
        for path in folder.glob("rank_*"):
            shutil.copyfile(path, copy / path.name)
        _rewrite(copy, _name_groups)
        done, note = _analyse(copy, timeout_s), ""
        if done.returncode != 0 and "name formatting error" in done.stderr:
            _rewrite(copy, _as_nccl)  # an analyser older than gloo's records (torch 2.11)
            done = _analyse(copy, timeout_s)
            note = "(gloo's entries relabelled nccl: this torch's analyser reads only NCCL's)\n"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"the flight-record analyser failed: {last}")
    return note + (done.stdout + done.stderr).strip()  # it reports through logging, on stderr


# NCCL_DEBUG=INFO lines (NCCL 2.19-2.28), after a "host:pid:tid [device] NCCL INFO " prefix:
#   NCCL version 2.28.9+cuda13.0
#   Using network Socket
#   comm 0x55d0 rank 0 nranks 2 cudaDev 0 nvmlDev 0 busId 18000 commId 0x9f1e - Init START
#   Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read          (also SHM/direct/direct, and
#   Channel 02/0 : 1[1] -> 0[0] [receive] via NET/IB/0/GDRDMA   NET/... with [send]/[receive])
_NCCL_VERSION = re.compile(r"NCCL INFO NCCL version (\S+)")
_NCCL_NETWORK = re.compile(r"NCCL INFO Using network (\S+)")
_NCCL_RANKS = re.compile(r"NCCL INFO comm \S+ rank \d+ nranks (\d+)")
_NCCL_CHANNEL = re.compile(r"NCCL INFO Channel (\d+)(?:/\d+)? : (\d+)\[\w+\] -> (\d+)\[\w+\]"
                           r"(?: \[(?:send|receive)\])? via (\S+)")


@dataclass
class NcclLinks:
    """What ``NCCL_DEBUG=INFO`` says about how a job's ranks were connected."""

    version: str
    network: str  # the network NCCL would use between hosts
    ranks: int
    links: dict[tuple[int, int], dict[str, int]]  # (from rank, to rank) -> {transport: channels}

    def lines(self) -> list[str]:
        head = (f"NCCL {self.version}, {self.ranks} rank(s); network between hosts: "
                f"{self.network}")
        if not self.links:
            return [head, "no connection: a single rank has no other rank to send to"]
        return [head] + [f"rank {a} -> rank {b}: " + ", ".join(
            f"{transport} on {n} channel{'s' * (n > 1)}" for transport, n in sorted(by.items()))
            for (a, b), by in sorted(self.links.items())]


def nccl_links(log: str) -> NcclLinks:
    """Read NCCL's version, network, number of ranks and the transport of each pair of ranks
    out of the ``NCCL_DEBUG=INFO`` log of a job (all ranks' lines, in any order)."""
    version, network = _NCCL_VERSION.search(log), _NCCL_NETWORK.search(log)
    ranks = [int(n) for n in _NCCL_RANKS.findall(log)]
    if version is None or not ranks:
        raise ValueError("no NCCL_DEBUG=INFO lines in this log: run the job on GPUs (NCCL) "
                         "with NCCL_DEBUG=INFO in its environment")
    channels: dict[tuple[int, int], dict[str, set[int]]] = {}
    for channel, src, dst, transport in _NCCL_CHANNEL.findall(log):
        pair = channels.setdefault((int(src), int(dst)), {})
        pair.setdefault(transport, set()).add(int(channel))
    return NcclLinks(version.group(1), network.group(1) if network else "none", max(ranks),
                     {pair: {t: len(c) for t, c in by.items()} for pair, by in channels.items()})
