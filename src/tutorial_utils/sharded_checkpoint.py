"""Checkpoints of sharded training state that a job of any shape can resume from.

``torch.save(model.state_dict())`` on rank 0 of an FSDP job saves rank 0's shards only: each
value is a DTensor holding its slice. ``torch.distributed.checkpoint`` (DCP) has every rank
write its own shards and a metadata file that says where each slice of each tensor lives, so
a job with another number of processes reads exactly the slices it needs ("resharding").
``get_state_dict`` / ``set_state_dict`` give the model's and the optimizer's state in a form
that does not depend on the wrapper (FSDP, DDP or none), keyed by parameter names.

A save is atomic: the shards go to a temporary folder that rank 0 renames into place only
after every rank has finished writing, so a job killed mid-save leaves the previous checkpoint
usable. Every rank must see the same folder (one machine, or a shared file system). Before the
rename, rank 0 writes the SHA-256 of every file to ``digests.json``: DCP checks no checksum,
and a flipped bit in a shard would load as an altered weight without a word. A load verifies
every file first; any damage, or a checkpoint of another model, is one ``CheckpointError``.
A step folder without ``digests.json`` (written before digests existed, or copied in part) is
passed over with a line that says so, is never deleted by the pruning of old checkpoints, and
is loaded, unverified, only when the caller accepts it explicitly.

Loading runs code the checkpoint may hold: DCP reads ``.metadata`` with Python's ``pickle``,
which executes whatever a crafted file asks, unlike ``torch.load(weights_only=True)``. So load
only checkpoints you trust; :func:`load_sharded` refuses a folder that other users can write to.

Buffers that FSDP leaves whole, such as BatchNorm's running statistics, are saved once. Under
FSDP each rank updates its own copy and nothing synchronises them (DDP copies rank 0's into
every rank at each forward), so the copies differ by rank; only the parameters and the
optimizer state are sharded and restored exactly.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from .checkpoint import CheckpointError
from .parallel.distributed import DistContext

_STEP_DIR = re.compile(r"^step-(\d+)$")
DIGESTS = "digests.json"  # written last: a folder with it is complete


def save_sharded(root: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                 ctx: DistContext) -> Path:
    """Every rank writes its shards to ``root/.step-N.tmp``; rank 0 then renames it ``step-N``.

    The rename is the commit: a job killed before it leaves the temporary folder, which
    :func:`latest_checkpoint` ignores, and the previous checkpoint intact.
    """
    return commit(root, write_uncommitted(root, step, model, optimizer, ctx), ctx)


def write_uncommitted(root: Path, step: int, model: nn.Module,
                      optimizer: torch.optim.Optimizer, ctx: DistContext) -> Path:
    """The first half of :func:`save_sharded`: the shards, in a folder no loader reads."""
    tmp = root / f".step-{step:06d}.tmp"
    if ctx.is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was killed
        tmp.mkdir(parents=True)
    ctx.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)  # DTensors: this rank's shards
    dcp.save({"model": model_sd, "optim": optim_sd, "step": step}, checkpoint_id=tmp,
             no_dist=not ctx.is_distributed)
    return tmp


def commit(root: Path, tmp: Path, ctx: DistContext) -> Path:
    """Rename the written folder into place once every rank has finished writing."""
    final = root / tmp.name[1:].removesuffix(".tmp")
    ctx.barrier()  # dcp.save returned everywhere: all shards and the metadata are on disk
    if ctx.is_main:
        digests = {p.name: _sha256(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        (tmp / DIGESTS).write_text(json.dumps(digests, indent=1))
        _only_owner_writes(tmp)  # a load runs the pickle in .metadata: nobody else may edit it
        if final.exists():  # the same step saved again by a resumed job
            _remove_or_set_aside(final)
        tmp.rename(final)  # atomic on one file system; readers see no folder or a whole one
        for old in _saved(root)[:-2]:  # keep the last two that a save wrote (with digests)
            shutil.rmtree(old)
    ctx.barrier()
    return final


def _steps(root: Path) -> list[Path]:
    """The ``step-N`` folders under ``root``, oldest first."""
    found = [p for p in root.glob("step-*") if _STEP_DIR.match(p.name) and p.is_dir()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def _saved(root: Path) -> list[Path]:
    """The step folders a save wrote: those with digests, oldest first."""
    return [p for p in _steps(root) if (p / DIGESTS).is_file()]


def _only_owner_writes(folder: Path) -> None:
    for p in [folder, *folder.iterdir()]:  # umask 002 would leave them group-writable
        os.chmod(p, p.stat().st_mode & ~(stat.S_IWGRP | stat.S_IWOTH))


def _remove_or_set_aside(final: Path) -> None:
    """Delete an earlier save of this step; keep, renamed, a folder that no save wrote."""
    if (final / DIGESTS).is_file():
        shutil.rmtree(final)
        return
    aside, n = final.with_name(f"{final.name}.undigested"), 1
    while aside.exists():
        aside, n = final.with_name(f"{final.name}.undigested-{n}"), n + 1
    final.rename(aside)
    print(f"{final} has no {DIGESTS} (no save of this program wrote it): kept as "
          f"{aside.name}", file=sys.stderr, flush=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()


def latest_checkpoint(root: Path, accept_undigested: bool = False,
                      quiet: bool = False) -> Path | None:
    """The newest complete ``step-N`` folder under ``root``; temporary folders are ignored.

    A step folder without digests (written before digests existed, or copied in part) cannot
    be verified: it is passed over, and a line on stderr (unless ``quiet``) says so, unless
    ``accept_undigested``: then the newest folder holding DCP's ``.metadata`` is taken, digests
    or not (and :func:`load_sharded` must be told to load it unverified).
    """
    steps = _steps(root)
    usable = [p for p in steps if (p / DIGESTS).is_file()
              or (accept_undigested and (p / ".metadata").is_file())]
    found = usable[-1] if usable else None
    for p in steps[steps.index(found) + 1 if found else 0:]:
        if not quiet:
            why = "no .metadata either" if accept_undigested else "unverified without it; " \
                "to resume from it anyway, accept folders without digests (--accept-undigested)"
            print(f"{p} passed over: no {DIGESTS} (written before digests existed, or copied "
                  f"in part); {why}", file=sys.stderr, flush=True)
    return found


def verify(path: Path) -> None:
    """Raise ``CheckpointError`` unless every file of ``path`` matches its recorded digest."""
    advice = f"delete {path} to resume from the checkpoint before it, or start afresh"
    try:
        digests = json.loads((path / DIGESTS).read_text())
    except (OSError, ValueError):
        raise CheckpointError(f"{path} has no readable {DIGESTS}: not a complete checkpoint; "
                              f"{advice}") from None
    for name, digest in digests.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{path} lacks {name}; {advice}")
        if _sha256(file) != digest:
            raise CheckpointError(f"{file} does not match its digest (damaged); {advice}")


def load_sharded(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                 require_digests: bool = True) -> int:
    """Load a checkpoint into ``model`` and ``optimizer``, sharded or not; returns its step.

    DCP reads into the tensors it is given, so the state dicts of this job's model and
    optimizer say which slices each rank needs, whatever the job that wrote them.

    Loading can execute code: DCP reads ``.metadata`` with ``pickle``, which runs whatever a
    crafted file asks (``torch.load(weights_only=True)`` would refuse it; DCP has no such
    mode). Load only checkpoints you trust: a folder that other users can write to is refused.
    ``require_digests=False`` loads a folder without digests, unverified.
    """
    _refuse_writable_by_others(path)
    if require_digests or (path / DIGESTS).exists():
        verify(path)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "step": -1}
    try:
        dcp.load(state, checkpoint_id=path, no_dist=not torch.distributed.is_initialized())
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    # DCP's CheckpointException derives from BaseException: `except Exception` misses it
    except torch.OutOfMemoryError:  # a RuntimeError, but the checkpoint is not at fault
        raise
    except (CheckpointException, RuntimeError, KeyError, ValueError) as err:
        why = (str(err).strip().splitlines() or [type(err).__name__])[-1][:160]
        raise CheckpointError(f"{path} does not fit this model and optimizer (written for "
                              f"another --model?): {why}") from None
    return state["step"]


def _refuse_writable_by_others(path: Path) -> None:
    if not path.exists():
        return  # verify() says what is missing
    for p in [path, *path.iterdir()] if path.is_dir() else [path]:
        mode = p.stat().st_mode
        if mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise CheckpointError(
                f"{p} can be written by other users (mode {stat.filemode(mode)}), and loading "
                "the checkpoint runs the pickle in its .metadata, which can execute code; if "
                f"you trust its contents, chmod -R go-w {path}")
