"""Which devices to run on: GPUs when present, the CPU otherwise."""

from __future__ import annotations

import os

import torch


class NotEnoughGPUsError(RuntimeError):
    """Raised when more GPUs are requested than this process can see."""


def gpu_count() -> int:
    """Number of CUDA GPUs visible to this process (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def default_device() -> torch.device:
    """The first GPU if there is one, else the CPU."""
    return torch.device("cuda:0") if gpu_count() > 0 else torch.device("cpu")


def require_gpus(n: int) -> list[torch.device]:
    """Return ``n`` GPU devices, or raise a one-line error saying what is available.

    ``n = 0`` means "no GPU needed" and returns an empty list.
    """
    if n < 0:
        raise ValueError(f"the number of GPUs must be >= 0, got {n}")
    have = gpu_count()
    if n > have:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        raise NotEnoughGPUsError(
            f"asked for {n} GPU(s) but this machine has {have}{where}; "
            f"ask for at most {have}, or run on a machine with more GPUs"
        )
    return [torch.device(f"cuda:{i}") for i in range(n)]


def devices_for(n: int) -> list[torch.device]:
    """``n`` places to put work on: distinct GPUs when there are enough, else CPU repeats.

    Chapters that need several devices use this so they still run (more slowly, and saying
    so) on a laptop: with fewer GPUs than asked for, every slot falls back to one device.
    """
    if n < 1:
        raise ValueError(f"need at least one device, got {n}")
    have = gpu_count()
    if have >= n:
        return require_gpus(n)
    return [default_device()] * n
