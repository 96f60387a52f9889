"""Collectives by hand: the ring all-reduce, bus bandwidth, and the alpha-beta cost model.

- :func:`ring_all_reduce` is the bandwidth-optimal all-reduce (Patarasuk & Yuan, 2009): a
  reduce-scatter around a ring of ranks, then an all-gather around it, each N-1 steps that move
  1/N of the buffer. It uses point-to-point sends so that every byte is visible. In practice
  call ``dist.all_reduce``: NCCL picks and tunes its own algorithms (ring, tree, ...).
- :func:`bus_factor` turns *algorithm bandwidth* (size / time) into *bus bandwidth*, the number
  NCCL's tests report so that it can be compared with a link's peak whatever the number of
  ranks N: all-reduce 2(N-1)/N, reduce-scatter and all-gather (N-1)/N, broadcast 1 (NVIDIA,
  nccl-tests, ``doc/PERFORMANCE.md``). Sizes follow the same convention: the whole buffer of an
  all-reduce or a broadcast, the input of a reduce-scatter, the output of an all-gather.
- :func:`fit_alpha_beta` fits the latency-bandwidth model t(n) = alpha + n / beta;
  :func:`ring_all_reduce_seconds` predicts a ring all-reduce from a bus bandwidth, which
  :func:`measure_bus_bandwidth` measures.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist


def ring_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over all ranks in place, the way a ring does; returns ``tensor``.

    Rank r sends to r+1 and receives from r-1. The buffer is cut into N chunks.
    Reduce-scatter: at step s rank r passes on chunk r-s and adds the chunk r-s-1 it receives;
    after N-1 steps it holds the complete sum of chunk r+1. All-gather: at step s it passes on
    the complete chunk r+1-s and stores the complete chunk r-s it receives. Each rank sends
    2(N-1) chunks, 2(N-1)/N of the buffer, whatever N is.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if world == 1:
        return tensor
    if not tensor.is_contiguous() or tensor.numel() < world:
        raise ValueError(f"need a contiguous tensor of at least {world} elements")
    # Views into the tensor: adding into a chunk, or receiving into it, writes the result.
    # The sizes differ by one element at most when N does not divide the length.
    chunks = tensor.view(-1).tensor_split(world)
    right, left = (rank + 1) % world, (rank - 1) % world
    inbox = torch.empty_like(chunks[0])  # tensor_split puts the larger chunks first
    for step in range(world - 1):  # reduce-scatter
        send, mine = chunks[(rank - step) % world], chunks[(rank - step - 1) % world]
        received = inbox[: mine.numel()]
        exchange(send, received, right, left)
        mine += received
    for step in range(world - 1):  # all-gather
        send, mine = chunks[(rank + 1 - step) % world], chunks[(rank - step) % world]
        exchange(send, mine, right, left)
    return tensor


def exchange(send: torch.Tensor, recv: torch.Tensor, to: int, source: int) -> None:
    """Send ``send`` to rank ``to`` while receiving ``recv`` from rank ``source``."""
    # Both posted before either waits: if every rank first did a blocking send, each would
    # wait for a receive its neighbour has not posted yet. batch_isend_irecv also lets NCCL
    # launch the pair as one group, which it needs to avoid that deadlock on GPUs.
    ops = [dist.P2POp(dist.isend, send, to), dist.P2POp(dist.irecv, recv, source)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()


_BUS_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "ring_all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}


def bus_factor(collective: str, world_size: int) -> float:
    """Bus bandwidth / algorithm bandwidth for ``collective`` on ``world_size`` ranks."""
    if collective not in _BUS_FACTORS:
        raise ValueError(f"unknown collective {collective!r}; one of {sorted(_BUS_FACTORS)}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return _BUS_FACTORS[collective](world_size)


def algbw_gbps(nbytes: float, seconds: float) -> float:
    """Algorithm bandwidth in GB/s: the size of the operation over its time."""
    return nbytes / seconds / 1e9


def busbw_gbps(collective: str, nbytes: float, seconds: float, world_size: int) -> float:
    """Bus bandwidth in GB/s: what each rank's link carried, comparable with its peak."""
    return algbw_gbps(nbytes, seconds) * bus_factor(collective, world_size)


@dataclass(frozen=True)
class AlphaBeta:
    """t(n) = alpha + n / beta: a fixed cost of ``alpha_s`` seconds, then ``beta`` bytes/s."""

    alpha_s: float
    beta: float  # bytes per second, in the size convention of the collective it was fitted to

    def predict_s(self, nbytes: float) -> float:
        return self.alpha_s + nbytes / self.beta

    @property
    def half_bytes(self) -> float:
        """n_1/2 = alpha * beta: below it latency dominates, above it bandwidth (Hockney)."""
        return self.alpha_s * self.beta


def fit_alpha_beta(nbytes: Sequence[float], seconds: Sequence[float]) -> AlphaBeta:
    """Fit t(n) = alpha + n / beta to measured (bytes, seconds) points, in relative error.

    The sizes span six orders of magnitude, and so do the times: an ordinary least-squares fit
    would weigh the large messages alone and leave alpha to chance (on CPU processes, a
    negative intercept). Each point's error counts relative to its own time instead, so the
    small messages set alpha and the large ones beta, and the worst error is a percentage.
    """
    n, t = np.asarray(nbytes, dtype=float), np.asarray(seconds, dtype=float)
    if n.shape != t.shape or n.ndim != 1 or len(n) < 2:
        raise ValueError("need at least two (bytes, seconds) points of the same length")
    if (t <= 0).any():
        raise ValueError("every measured time must be > 0")
    scale = n.max()  # sizes span 1e3..1e9: scaled to <= 1, both columns are of similar size
    design = np.stack([np.ones_like(n), n / scale], axis=1) / t[:, None]  # rows / t: relative
    (alpha, per_byte), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    if alpha < 0:  # no negative latency: the best fit with alpha >= 0 then has alpha = 0
        alpha, per_byte = 0.0, float(design[:, 1].sum() / (design[:, 1] @ design[:, 1]))
    if per_byte <= 0:
        raise ValueError("the measured time does not grow with the size: no bandwidth to fit")
    return AlphaBeta(float(alpha), float(scale / per_byte))


def ring_all_reduce_seconds(nbytes: float, world_size: int, bus_gbps: float) -> float:
    """Time of a ring all-reduce of ``nbytes``: each GPU sends and receives 2(N-1)/N of it.

    ``bus_gbps`` is the bus bandwidth (GB/s) as NCCL's tests report it, i.e. already
    normalised by that 2(N-1)/N factor: measure it with :func:`measure_bus_bandwidth`.
    """
    if world_size < 2:
        return 0.0
    return bus_factor("all_reduce", world_size) * nbytes / (bus_gbps * 1e9)


def measure_bus_bandwidth(nbytes: int, device: torch.device, repeats: int = 10) -> float:
    """All-reduce bus bandwidth in GB/s over the process group, for a float32 buffer of
    ``nbytes``: the median of ``repeats`` timed calls after warm-up."""
    from ..timing import benchmark

    buf = torch.ones(nbytes // 4, device=device)
    t = benchmark(lambda: dist.all_reduce(buf), warmup=3, repeats=repeats, device=device)
    return busbw_gbps("all_reduce", nbytes, t.median_ms * 1e-3, dist.get_world_size())
