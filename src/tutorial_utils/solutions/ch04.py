"""Solutions to the exercises of chapter 4, "Data parallelism"."""

from __future__ import annotations

from ..parallel.collectives import ring_all_reduce_seconds


def all_reduce_ms(grad_bytes: float, world_size: int = 8, bus_gbps: float = 200.0) -> float:
    """Exercise 1: a ring all-reduce of ``grad_bytes`` on ``world_size`` GPUs at ``bus_gbps``."""
    return ring_all_reduce_seconds(grad_bytes, world_size, bus_gbps) * 1e3


def weak_scaling_prediction(single_ms: float, compute_ms: float, grad_bytes: float, n: int,
                            bus_gbps: float, hidden: float = 0.0) -> float:
    """Exercise 2 (and chapter 5b's exercise 2): the ring model's weak-scaling speed-up.

    Each of ``n`` GPUs runs its own full step (``compute_ms``, DDP inside ``no_sync``) plus the
    part of a ring all-reduce of ``grad_bytes`` that backward does not hide (``hidden`` is the
    fraction hidden: 0 no overlap, 1 all); it processes ``n`` times the images of the best
    single GPU's ``single_ms`` step.
    """
    if not 0 <= hidden <= 1:
        raise ValueError(f"hidden is a fraction in [0, 1], got {hidden}")
    ring_ms = ring_all_reduce_seconds(grad_bytes, n, bus_gbps) * 1e3
    return n * single_ms / (compute_ms + (1 - hidden) * ring_ms)
