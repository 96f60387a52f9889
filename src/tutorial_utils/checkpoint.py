"""Checkpoints written atomically and read back safely.

A checkpoint is written to a temporary file in the same folder and renamed over the old one:
a crash mid-write leaves the previous checkpoint intact. It is read with
``torch.load(weights_only=True)``, which refuses to run code hidden in a file.
"""

from __future__ import annotations

import os
import pickle
import random
from pathlib import Path
from typing import Any

import torch


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message says what to do."""


def rng_state(device: torch.device) -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        torch.save(state, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one
    finally:
        tmp.unlink(missing_ok=True)


def load_checkpoint(path: Path, expect: dict[str, Any], required=()) -> dict[str, Any]:
    """Load ``path``; ``expect`` holds settings the checkpoint must match (e.g. depth, width)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError, OSError) as err:
        raise CheckpointError(
            f"{path} is corrupt or not a checkpoint ({type(err).__name__}); "
            "delete it to start afresh, or resume from another --out"
        ) from None
    saved = state.get("config", {}) if isinstance(state, dict) else {}
    wrong = {k: (saved.get(k), v) for k, v in expect.items() if saved.get(k) != v}
    if wrong:
        diff = ", ".join(f"{k}={old} (this run: {new})" for k, (old, new) in wrong.items())
        raise CheckpointError(
            f"{path} was written with {diff}; use the same settings or another --out"
        )
    return state


def gather_rng_states(ctx) -> list[dict[str, Any]] | None:  # interim; replaced by the fix
    import torch.distributed as dist

    mine = rng_state(ctx.device)
    if not ctx.is_distributed:
        return [mine]
    states = [None] * ctx.world_size
    dist.all_gather_object(states, mine)
    return states


def rng_state_for_rank(saved: list[dict[str, Any]], rank: int) -> dict[str, Any]:
    return saved[rank]


def check_world_size(state: dict[str, Any], world_size: int) -> None:
    if state["world_size"] != world_size:
        raise CheckpointError(f"checkpoint.pt was written by {state['world_size']} processes, "
                              f"this run has {world_size}")
