"""Checkpoints written atomically and read back safely.

A checkpoint is written to a temporary file in the same folder and renamed over the old one:
a crash mid-write leaves the previous checkpoint intact (and its temporary file, which the next
save removes). It is read with ``torch.load(weights_only=True)``, which refuses to run code
hidden in a file, after every member of the zip archive ``torch.save`` writes has passed its
CRC check. A CRC vouches for one member only: a digest of the whole named state, stored with it
and recomputed on loading, catches what the CRCs cannot (two same-sized tensors swapped, a
member copied from another checkpoint). Any damage is one ``CheckpointError`` that says what to
do.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import socket
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .jsonl import fsync_path

if TYPE_CHECKING:
    from .parallel.distributed import DistContext

AFRESH = "delete it to start afresh, or resume from another --out"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message says what to do."""


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's torch, Python and (on a GPU) CUDA generator states."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Restore what ``rng_state`` returned."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def gather_rng_states(ctx: DistContext) -> list[dict[str, Any]] | None:
    """Every rank's RNG state, in rank order, on rank 0 (None elsewhere); call it on all ranks.

    Each rank draws its own augmentations and dropout: resuming every rank from rank 0's
    state would make the ranks draw alike.
    """
    mine = rng_state(ctx.device)
    if not ctx.is_distributed:
        return [mine]
    everyone: list[Any] | None = [None] * ctx.world_size if ctx.is_main else None
    dist.gather_object(mine, everyone, dst=0)
    return everyone


def rng_state_for_rank(saved: list[dict[str, Any]], rank: int) -> dict[str, Any]:
    """This rank's state from what ``gather_rng_states`` returned on rank 0."""
    if not isinstance(saved, list) or not 0 <= rank < len(saved):
        held = f"{len(saved)} RNG states" if isinstance(saved, list) else "one state for all ranks"
        raise CheckpointError(f"the checkpoint holds {held}, none for rank {rank}; {AFRESH}")
    return saved[rank]


def check_world_size(
    state: dict[str, Any], world_size: int, path: Path | str = "the checkpoint"
) -> None:
    """Refuse to resume ``state`` (from ``path``) with another number of processes."""
    saved = state.get("world_size")
    if saved is None:
        raise CheckpointError(f"{path} does not record how many processes wrote it; {AFRESH}")
    if saved != world_size:
        raise CheckpointError(
            f"{path} was written by {_processes(saved)}, this run has {world_size}: the per-GPU "
            "batch, the data shards and (with weak scaling) the peak learning rate would change; "
            f"resume with {_processes(saved)}, or start afresh with another --out"
        )


def _processes(n: int) -> str:
    return f"{n} process" if n == 1 else f"{n} processes"


def state_digest(state: Any) -> str:
    """SHA-256 of a nested state: every key, value, and tensor (dtype, shape, bytes), in order."""
    h = hashlib.sha256()

    def feed(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            t = obj.detach().cpu().contiguous()
            h.update(f"tensor {t.dtype} {tuple(t.shape)};".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy())
        elif isinstance(obj, dict):
            h.update(f"dict {len(obj)};".encode())
            for key, value in obj.items():
                h.update(f"{key!r}:".encode())
                feed(value)
        elif isinstance(obj, list | tuple):
            h.update(f"{type(obj).__name__} {len(obj)};".encode())
            for value in obj:
                feed(value)
        else:
            h.update(f"{obj!r};".encode())

    feed(state)
    return h.hexdigest()


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write ``state`` and its digest to ``path`` atomically and durably (one writer per path
    at a time: a temporary file of this path is a killed writer's, and is removed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in _abandoned_temporaries(path):
        # tidying only: a leftover this writer may not remove (another user's, in a shared
        # folder) must not stop the save
        with contextlib.suppress(OSError):
            stale.unlink(missing_ok=True)
    body = {k: v for k, v in state.items() if k != "digest"}
    # a name of its own, so a second writer never writes into or deletes this one's file; the
    # writer's process id and machine in it tell a killed writer's file from a live one's
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.{socket.gethostname()}.",
                                suffix=".tmp", dir=path.parent)
    tmp = Path(name)
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide the checkpoint from the run's readers
        with os.fdopen(fd, "wb") as f:  # a file object: the archive's members are archive/...
            torch.save({**body, "digest": state_digest(body)}, f)
            f.flush()
            os.fsync(f.fileno())  # the data on disk before the rename points the name at it
        os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one
        fsync_path(path.parent)  # the rename is an entry in the folder: a crash could undo it
    finally:
        tmp.unlink(missing_ok=True)


def _abandoned_temporaries(path: Path) -> list[Path]:
    """Temporary files of ``path`` whose writer ran on this machine and is gone (killed
    mid-write: ``finally`` never ran); ``.<name>.<pid>.<host>.<random>.tmp``."""
    found = []
    for tmp in path.parent.glob(f".{path.name}.*.tmp"):
        rest = tmp.name[len(path.name) + 2 : -len(".tmp")]
        pid, _, host_and_random = rest.partition(".")
        host = host_and_random.rpartition(".")[0]
        if pid.isdigit() and host == socket.gethostname() and not _alive(int(pid)):
            found.append(tmp)
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: no signal, only the check that the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, and belongs to someone else
        return True
    return True


def load_checkpoint(
    path: Path, expect: dict[str, Any], required: Sequence[str] = (),
    upgrade: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Load ``path``: it must hold the keys ``required`` and match ``expect`` (depth, width...);
    ``upgrade`` reads the configuration an older checkpoint saved in today's terms."""
    state = _read(path)
    missing = [k for k in required if k not in state]
    if missing:  # caught here, not as a KeyError halfway through restoring
        raise CheckpointError(f"{path} lacks {', '.join(missing)}: not a checkpoint of this "
                              f"trainer; {AFRESH}")
    saved = state.get("config", {})
    if upgrade is not None:
        saved = upgrade(saved)
    wrong = {k: (saved.get(k), v) for k, v in expect.items() if saved.get(k) != v}
    if wrong:
        diff = ", ".join(f"{k}={old} (this run: {new})" for k, (old, new) in wrong.items())
        raise CheckpointError(
            f"{path} was written with {diff}; use the same settings or another --out"
        )
    return state


def _read(path: Path) -> dict[str, Any]:
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()  # reads every member: torch.load checks no CRC
        if bad is None:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - damage surfaces as any type; the advice is one
        raise _damaged(path, type(err).__name__) from err
    if bad is not None:  # "<archive folder>/data/3": the folder is the writer's file name
        raise _damaged(path, f"its member {bad.split('/', 1)[-1]} fails its CRC check")
    if not isinstance(state, dict):
        raise _damaged(path, f"it holds a {type(state).__name__}, not a dict")
    saved = state.pop("digest", None)
    if saved is None:  # torch.save of a dict: an older trainer's file, or someone else's
        raise CheckpointError(f"{path} has no digest of its state: it was not written by this "
                              f"trainer's save_checkpoint (an older version?); {AFRESH}")
    if saved != state_digest(state):
        raise _damaged(path, "its content does not match the digest written with it")
    return state


def _damaged(path: Path, why: str) -> CheckpointError:
    return CheckpointError(f"{path} is corrupt or not a checkpoint ({why}); {AFRESH}")
