"""Solutions to the exercises of chapter 3b, "Collectives"."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..parallel.collectives import AlphaBeta, bus_factor


def root_all_reduce(tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
    """Exercise 1: all-reduce through one rank. ``root`` receives every other rank's buffer,
    sums them, and sends the sum back to each: correct, but ``root``'s link carries it all."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if rank != root:
        dist.send(tensor, root)
        dist.recv(tensor, root)
        return tensor
    inbox = torch.empty_like(tensor)
    for other in range(world):
        if other != root:
            dist.recv(inbox, other)
            tensor += inbox
    for other in range(world):
        if other != root:
            dist.send(tensor, other)
    return tensor


def busiest_rank_bytes(algorithm: str, nbytes: float, world_size: int) -> float:
    """Exercise 1: bytes the busiest rank sends in an all-reduce of ``nbytes`` ("ring" or
    "root"); it receives as many. A ring rank's stays below 2n; the root's grows as (N-1)n."""
    n = world_size
    if algorithm == "ring":
        return 2 * (n - 1) / n * nbytes
    if algorithm == "root":
        return (n - 1) * nbytes
    raise ValueError(f"algorithm must be 'ring' or 'root', got {algorithm!r}")


def bucket_for_efficiency(model: AlphaBeta, efficiency: float) -> float:
    """Exercise 2: the smallest message that reaches ``efficiency`` of the bandwidth beta.

    A message of b bytes runs at b / (alpha + b / beta); that is efficiency * beta when
    b = alpha * beta * efficiency / (1 - efficiency).
    """
    if not 0 < efficiency < 1:
        raise ValueError(f"efficiency must be in (0, 1), got {efficiency}")
    return model.half_bytes * efficiency / (1 - efficiency)


def rescale_ring(model: AlphaBeta, from_world: int, to_world: int) -> AlphaBeta:
    """Exercise 3: an all-reduce model fitted on ``from_world`` ranks, moved to ``to_world``.

    Assumes a ring whose 2(N-1) steps each cost the same latency and whose links keep the
    same bus bandwidth: alpha grows as 2(N-1), the algorithm bandwidth shrinks as N/2(N-1).
    """
    if min(from_world, to_world) < 2:
        raise ValueError("a ring needs at least 2 ranks")
    alpha = model.alpha_s / (2 * (from_world - 1)) * (2 * (to_world - 1))
    bus = model.beta * bus_factor("all_reduce", from_world)
    return AlphaBeta(alpha, bus / bus_factor("all_reduce", to_world))
