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

:class:`AsyncCheckpointer` is the training loop's save: ``dcp.async_save`` copies this rank's
state into host memory (pinned, on a GPU) and writes it from a background thread while training
goes on; the step waits only for the copy. Rank 0 commits the folder (digests, rename) once DCP
has finished writing every rank's part, from that thread too.

Buffers that FSDP leaves whole, such as BatchNorm's running statistics, are saved once. Under
FSDP each rank updates its own copy and nothing synchronises them (DDP copies rank 0's into
every rank at each forward), so the copies differ by rank; only the parameters and the
optimizer state are sharded and restored exactly.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import stat
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from .checkpoint import CheckpointError
from .parallel.distributed import DistContext

_STEP_DIR = re.compile(r"^step-(\d+)$")
DIGESTS = "digests.json"  # written last: a folder with it is complete
# torch 2.11's DefaultStager copies a state once: its second stage() raises KeyError deep in
# its deepcopy (2.14's does not), so there the saver makes a new one for every save
STAGER_ONCE = tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 14)


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
    tmp = _fresh_folder(root, step, ctx)
    model_sd, optim_sd = get_state_dict(model, optimizer)  # DTensors: this rank's shards
    dcp.save({"model": model_sd, "optim": optim_sd, "step": step}, checkpoint_id=tmp,
             no_dist=not ctx.is_distributed)
    return tmp


def commit(root: Path, tmp: Path, ctx: DistContext) -> Path:
    """Rename the written folder into place once every rank has finished writing."""
    ctx.barrier()  # dcp.save returned everywhere: all shards and the metadata are on disk
    final = _commit_written(root, tmp) if ctx.is_main else _final(root, tmp)
    ctx.barrier()
    return final


def _final(root: Path, tmp: Path) -> Path:
    return root / tmp.name[1:].removesuffix(".tmp")


def _commit_written(root: Path, tmp: Path) -> Path:
    """Rank 0's part of :func:`commit`, once every shard and the metadata are on disk."""
    final = _final(root, tmp)
    digests = {p.name: _sha256(p) for p in sorted(tmp.iterdir()) if p.is_file()}
    (tmp / DIGESTS).write_text(json.dumps(digests, indent=1))
    _only_owner_writes(tmp)  # a load runs the pickle in .metadata: nobody else may edit it
    if final.exists():  # the same step saved again by a resumed job
        _remove_or_set_aside(final)
    tmp.rename(final)  # atomic on one file system; readers see no folder or a whole one
    for old in _saved(root)[:-2]:  # keep the last two that a save wrote (with digests)
        shutil.rmtree(old)
    return final


def _fresh_folder(root: Path, step: int, ctx: DistContext) -> Path:
    """``root/.step-N.tmp``, emptied of what a killed save left, on every rank."""
    tmp = root / f".step-{step:06d}.tmp"
    if ctx.is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was killed
        tmp.mkdir(parents=True)
    ctx.barrier()
    return tmp


class AsyncCheckpointer:
    """Sharded checkpoints saved from the training loop without stopping it for the writing.

    ::

        saver = AsyncCheckpointer(root, ctx)
        blocked_s = saver.save(step, model, optimizer)  # returns once the state is copied
        ...                                              # training goes on while it is written
        saver.close()                                    # the last save written and committed

    ``dcp.async_save`` first copies ("stages") this rank's shards into host memory, the only
    part the step waits for: into pinned memory on a GPU (a copy at full link speed, reused by
    the next save), into ordinary memory on a CPU. A background thread then writes the files,
    its collectives on a process group of its own (gloo), so that they never interleave with
    the training's. DCP's last step gathers every rank's result on rank 0 and writes the
    metadata: when rank 0's save is done, every rank's is, and rank 0 commits the folder (its
    digests, then the rename) in that thread. A job killed before the commit leaves a
    temporary folder that no resume reads. ``asynchronous=False`` writes before returning,
    the cost a synchronous save puts on the step.
    """

    def __init__(self, root: Path, ctx: DistContext, asynchronous: bool = True) -> None:
        self.root, self.ctx, self.asynchronous = root, ctx, asynchronous
        # every rank creates the group, in the same order: a collective call
        self.group = dist.new_group(backend="gloo") if ctx.is_distributed else None
        if not ctx.is_distributed:
            # One process, no_dist=True: DCP still warns that it assumes one process, from
            # the writing thread, where a catch_warnings() around the call does not reach.
            warnings.filterwarnings("ignore", message=SINGLE_PROCESS_WARNING)
        self.stager = self._new_stager()
        self._upload: Future | None = None
        self._committed = threading.Event()
        self._committed.set()
        self._error: BaseException | None = None

    def _new_stager(self):
        """Pinned host memory and non-blocking copies on a GPU; the copy itself is done before
        async_save returns, so that the optimizer's next update cannot race it."""
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        gpu = self.ctx.device.type == "cuda"
        return DefaultStager(StagingOptions(use_pinned_memory=gpu, use_shared_memory=False,
                                            use_async_staging=False, use_non_blocking_copy=gpu))

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
             extra: Callable[[Path], None] | None = None) -> float:
        """Start saving ``step``; the seconds the caller was held (the copy of the state).

        ``extra(folder)``, on rank 0, writes small files of its own into the folder before
        the shards (they are committed, and their digests checked, with them).
        """
        t0 = time.perf_counter()
        self.wait()  # the staging buffers are reused: the last save must be written
        if STAGER_ONCE:  # torch 2.11's stager fails its second copy: one per save there
            self.stager = self._new_stager()
        tmp = _fresh_folder(self.root, step, self.ctx)
        if self.ctx.is_main and extra is not None:
            extra(tmp)
        if self.ctx.device.type == "cuda":  # the optimizer's update done before the copy
            torch.cuda.current_stream().synchronize()
        model_sd, optim_sd = get_state_dict(model, optimizer)  # DTensors: this rank's shards
        self._committed.clear()
        with _single_process_quietly():
            self._upload = dcp.async_save(
                {"model": model_sd, "optim": optim_sd, "step": step}, checkpoint_id=tmp,
                process_group=self.group, async_stager=self.stager,
                no_dist=not self.ctx.is_distributed)
        if self.ctx.is_main:
            self._upload.add_done_callback(lambda done: self._commit(tmp, done))
        else:
            self._upload.add_done_callback(lambda _: self._committed.set())
        if not self.asynchronous:
            self.wait()
        return time.perf_counter() - t0

    def _commit(self, tmp: Path, done: Future) -> None:
        try:
            done.result()
            _commit_written(self.root, tmp)
        except BaseException as err:  # noqa: BLE001 - kept, and raised by the next wait()
            self._error = err
        finally:
            self._committed.set()

    def wait(self) -> None:
        """Until the save in flight is written (and, on rank 0, committed)."""
        if self._upload is not None:
            try:
                self._upload.result()
            except BaseException as err:  # noqa: BLE001
                self._error = self._error or err
            self._committed.wait()
            self._upload = None
        if self._error is not None:
            err, self._error = self._error, None
            raise CheckpointError(f"saving a checkpoint under {self.root} failed: "
                                  f"{type(err).__name__}: {err}") from err

    def close(self) -> None:
        """Wait for the last save, committed, on every rank (a collective call), then free the
        staging memory."""
        self.wait()
        self.ctx.barrier()  # rank 0's commit is done when it gets here
        self.stager.close()


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
                 require_digests: bool = True, *, verified: bool = False,
                 no_dist: bool | None = None) -> int:
    """Load a checkpoint into ``model`` and ``optimizer``, sharded or not; returns its step.

    DCP reads into the tensors it is given, so the state dicts of this job's model and
    optimizer say which slices each rank needs, whatever the job that wrote them.

    Loading can execute code: DCP reads ``.metadata`` with ``pickle``, which runs whatever a
    crafted file asks (``torch.load(weights_only=True)`` would refuse it; DCP has no such
    mode). Load only checkpoints you trust: a folder that other users can write to is refused.
    ``require_digests=False`` loads a folder without digests, unverified; ``verified``: the
    caller has just run :func:`verify` on it. ``no_dist``: load as a single process (default:
    when no process group exists).
    """
    _refuse_writable_by_others(path)
    if not verified and (require_digests or (path / DIGESTS).exists()):
        verify(path)
    if no_dist is None:
        no_dist = not torch.distributed.is_initialized()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "step": -1}
    try:
        with _single_process_quietly():
            dcp.load(state, checkpoint_id=path, no_dist=no_dist)
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


SINGLE_PROCESS_WARNING = "torch.distributed is disabled"


@contextlib.contextmanager
def _single_process_quietly() -> Iterator[None]:
    """Asked to save or load as one process, DCP still warns that it assumes so."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SINGLE_PROCESS_WARNING)
        yield


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
