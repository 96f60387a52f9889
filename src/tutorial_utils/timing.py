"""Timing that is right on GPUs: warm-up, synchronisation, CUDA events, median and spread.

CUDA kernels run asynchronously: a Python call returns once the work is *queued*. A host clock
read right after it measures the queueing, not the work. :func:`benchmark` warms up (first calls
pay for cuDNN autotuning, allocator growth, compilation), brackets every repeat with CUDA events
on the current stream, synchronises once at the end, and reports the median and quartiles.
:func:`tf32_enabled` and :func:`cudnn_autotuning` set, for one block, the two switches that
every measurement in the book states.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Timing:
    """Repeated measurements of one operation, in milliseconds."""

    samples_ms: tuple[float, ...]

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms)

    @property
    def q25_ms(self) -> float:
        return _quantile(self.samples_ms, 0.25)

    @property
    def q75_ms(self) -> float:
        return _quantile(self.samples_ms, 0.75)

    @property
    def spread(self) -> float:
        """Inter-quartile range relative to the median (0.02 means +-1 % around it)."""
        return (self.q75_ms - self.q25_ms) / self.median_ms if self.median_ms > 0 else 0.0

    def __str__(self) -> str:
        return f"{self.median_ms:.3f} ms (IQR {self.q25_ms:.3f}-{self.q75_ms:.3f}, n={len(self)})"

    def __len__(self) -> int:
        return len(self.samples_ms)


def _quantile(values: tuple[float, ...], q: float) -> float:
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo, hi = int(pos), min(int(pos) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _uses_cuda(device: torch.device | str | None) -> bool:
    if device is None:
        return torch.cuda.is_available()
    return torch.device(device).type == "cuda"


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for queued GPU work on ``device`` (no-op on the CPU)."""
    if _uses_cuda(device):
        torch.cuda.synchronize(device)


def benchmark(
    fn: Callable[[], object],
    *,
    warmup: int = 3,
    repeats: int = 10,
    device: torch.device | str | None = None,
) -> Timing:
    """Time ``fn()`` ``repeats`` times after ``warmup`` untimed calls.

    On a CUDA device each call is bracketed by CUDA events, so the host never waits between
    repeats and the GPU's queue stays full, as it does in training. On the CPU a monotonic
    clock is read around each call.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats=} {warmup=}")
    cuda = _uses_cuda(device)
    for _ in range(warmup):
        fn()
    synchronize(device)
    if cuda:
        with torch.cuda.device(device):
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
            for start, end in zip(starts, ends, strict=True):
                start.record()
                fn()
                end.record()
            torch.cuda.synchronize(device)  # the one host wait: all events are now complete
            samples = tuple(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))
    else:
        samples_list = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            samples_list.append((time.perf_counter() - t0) * 1e3)
        samples = tuple(samples_list)
    return Timing(samples)


def host_clock_without_sync(fn: Callable[[], object], repeats: int = 10) -> Timing:
    """The classic *wrong* way to time GPU code: host clock, no synchronisation.

    Kept for the book to measure what it gets wrong: on a GPU it reports how long it takes to
    *queue* the kernels. Never use it to make a decision.
    """
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return Timing(tuple(samples))


def cold_call_ms(fn: Callable[[], object], device: torch.device | str | None = None) -> float:
    """Wall time of one call including everything it waits for (use on a fresh operation)."""
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return (time.perf_counter() - t0) * 1e3


@contextlib.contextmanager
def tf32_enabled(enabled: bool) -> Iterator[None]:
    """Allow (or forbid) TF32 in matmuls and cuDNN convolutions, restoring the old settings.

    cuDNN convolutions default to TF32 already, so a true FP32 baseline must switch it off.
    """
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@contextlib.contextmanager
def cudnn_autotuning(enabled: bool = True) -> Iterator[None]:
    """Let cuDNN time its algorithms for each new shape (``cudnn.benchmark``), then restore."""
    old = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = enabled
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = old
