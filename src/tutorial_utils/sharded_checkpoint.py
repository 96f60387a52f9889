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

Buffers that FSDP leaves whole, such as BatchNorm's running statistics, are saved once. Under
FSDP each rank updates its own copy and nothing synchronises them (DDP copies rank 0's into
every rank at each forward), so the copies differ by rank; only the parameters and the
optimizer state are sharded and restored exactly.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
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
        if final.exists():  # the same step saved again by a resumed job
            shutil.rmtree(final)
        tmp.rename(final)  # atomic on one file system; readers see no folder or a whole one
        for old in sorted(p for p in root.iterdir() if _STEP_DIR.match(p.name))[:-2]:
            shutil.rmtree(old)  # keep the last two
    ctx.barrier()
    return final


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete ``step-N`` folder under ``root``: temporary folders, and step
    folders without their digests (emptied, or copied in part), are passed over."""
    found = [p for p in root.glob("step-*") if _STEP_DIR.match(p.name) and (p / DIGESTS).is_file()]
    return max(found, key=lambda p: int(p.name[5:]), default=None)


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


def load_sharded(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Load a checkpoint into ``model`` and ``optimizer``, sharded or not; returns its step.

    DCP reads into the tensors it is given, so the state dicts of this job's model and
    optimizer say which slices each rank needs, whatever the job that wrote them.
    """
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
