"""Several "nodes" on one host: one torchrun launcher per node, meeting through c10d rendezvous.

On a cluster each node runs the same command (``srun torchrun --nnodes=N ...``, see
``scripts/slurm/``) and the launchers find each other at the rendezvous endpoint, a host:port
on one of the nodes. Here every launcher runs on this host and the endpoint is a free loopback
port, which exercises exactly the same code path, so it runs in CI on CPUs (gloo) and on a
multi-GPU machine with one GPU per "node" (NCCL).
"""

from __future__ import annotations

import os
import selectors
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from .devices import gpu_count
from .jsonl import read_jsonl
from .launch import LaunchError, LaunchResult, failure_summary, kill_tree


def free_port() -> int:
    """A TCP port nobody listens on right now (never a hard-coded one)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_command(target: str, args: Sequence[str], *, nnodes: int, nproc_per_node: int,
                     endpoint: str, job_id: str, max_restarts: int = 0) -> list[str]:
    """The torchrun command every node runs (the same on each, as under SLURM)."""
    program = [target] if target.endswith(".py") else ["-m", target]
    return [
        sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
        f"--nproc_per_node={nproc_per_node}", "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}", f"--rdzv-id={job_id}", f"--max-restarts={max_restarts}",
        "--tee=3", *program, *args,
    ]


def simulate_nodes(
    target: str,
    args: Sequence[str] = (),
    *,
    nnodes: int = 2,
    nproc_per_node: int = 1,
    max_restarts: int = 0,
    timeout_s: float = 600.0,
    metrics_file: Path | None = None,
    echo: bool = True,
) -> LaunchResult:
    """Run ``nnodes`` launchers on this host; raise LaunchError if any node fails or hangs.

    With enough GPUs each node sees only its own (``CUDA_VISIBLE_DEVICES`` is set for the
    launcher process before anything imports torch there).
    """
    if metrics_file is not None:
        metrics_file.unlink(missing_ok=True)
    cmd = launcher_command(target, args, nnodes=nnodes, nproc_per_node=nproc_per_node,
                           endpoint=f"127.0.0.1:{free_port()}", job_id=uuid.uuid4().hex[:8],
                           max_restarts=max_restarts)
    per_node_gpus = gpu_count() // nnodes
    procs = []
    for node in range(nnodes):
        # torchrun limits OpenMP threads only for several workers per node; nodes that share
        # one host must also share its cores, or every process oversubscribes them.
        threads = str(max(1, (os.cpu_count() or 1) // (nnodes * nproc_per_node)))
        env = {"OMP_NUM_THREADS": threads, **os.environ, "PYTHONUNBUFFERED": "1"}
        if per_node_gpus >= nproc_per_node:
            first = node * nproc_per_node
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(first + i) for i in range(nproc_per_node))
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, bufsize=1, env=env, start_new_session=True))
    outputs: list[list[str]] = [[] for _ in procs]
    try:
        timed_out = _stream_all(procs, outputs, time.monotonic() + timeout_s, echo)
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p)
    text = "\n".join(f"[node {i}] {line}" for i, out in enumerate(outputs) for line in out)
    if timed_out:
        raise LaunchError(f"timed out after {timeout_s:.0f} s; all nodes were killed", text)
    for i, p in enumerate(procs):
        if p.wait() != 0:
            summary = failure_summary("\n".join(outputs[i]), p.returncode)
            raise LaunchError(f"node {i}: {summary}", text)
    metrics = read_jsonl(metrics_file) if metrics_file is not None else []
    return LaunchResult(0, text, metrics)


def _stream_all(procs: list[subprocess.Popen], outputs: list[list[str]], deadline: float,
                echo: bool) -> bool:
    sel = selectors.DefaultSelector()
    for i, p in enumerate(procs):
        sel.register(p.stdout, selectors.EVENT_READ, i)
    open_pipes = len(procs)
    while open_pipes:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return True
        for key, _ in sel.select(timeout=min(remaining, 1.0)):
            line = key.fileobj.readline()
            if not line:
                sel.unregister(key.fileobj)
                open_pipes -= 1
                continue
            outputs[key.data].append(line.rstrip("\n"))
            if echo:
                print(f"[node {key.data}] {outputs[key.data][-1]}", flush=True)
    return False
