"""Process-group set-up for 1..N processes, with teardown that cannot be skipped.

Under ``torchrun`` every process finds ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE`` in its
environment; run directly, a process is rank 0 of 1 and no process group is created. The
context object is passed explicitly to whatever needs it: there is no global singleton.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from ..devices import NotEnoughGPUsError, gpu_count, require_gpus

DeviceChoice = Literal["auto", "cpu", "cuda"]


@dataclass(frozen=True)
class DistContext:
    """Who this process is, and where it computes."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.is_distributed:
            dist.barrier()


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value is None else int(value)


def pick_device(local_rank: int, local_world_size: int, choice: DeviceChoice) -> torch.device:
    """The device of one process: its own GPU, or the CPU (a clear error if GPUs are short)."""
    if choice == "cpu" or (choice == "auto" and gpu_count() == 0):
        return torch.device("cpu")
    if gpu_count() == 0:
        raise NotEnoughGPUsError("--device cuda, but this machine has no GPU; use --device cpu")
    require_gpus(local_world_size)  # one GPU per process on this node, or a one-line error
    return torch.device(f"cuda:{local_rank}")


@contextlib.contextmanager
def distributed(
    device: DeviceChoice = "auto", timeout_s: float = 600.0
) -> Iterator[DistContext]:
    """Initialise the process group if launched by torchrun; always destroy it on exit.

    Backend: ``nccl`` when each process has a GPU, ``gloo`` on the CPU. ``timeout_s`` bounds
    how long a collective waits for a missing rank before failing instead of hanging.
    """
    rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    local_world = _env_int("LOCAL_WORLD_SIZE", world)
    dev = pick_device(local_rank, local_world, device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)  # before any CUDA work, so nothing lands on GPU 0 by mistake
    ctx = DistContext(rank, local_rank, world, dev)
    if world == 1:
        yield ctx
        return
    dist.init_process_group(
        backend="nccl" if dev.type == "cuda" else "gloo",
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=dev if dev.type == "cuda" else None,
    )
    try:
        yield ctx
    finally:
        dist.destroy_process_group()


def all_reduce_sum(ctx: DistContext, *values: float) -> list[float]:
    """Sum a few Python numbers over all ranks (one small collective)."""
    t = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    if ctx.is_distributed:
        dist.all_reduce(t)
    return t.tolist()
