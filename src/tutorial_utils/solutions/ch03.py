"""Solutions to the exercises of chapter 3, "Model parallelism"."""

from __future__ import annotations

from ..parallel.model_parallel import bubble_fraction, pipeline_ms


def micro_batches_for_bubble(stages: int, bubble: float) -> int:
    """Exercise 1: the fewest micro-batches whose fill/drain bubble is at most ``bubble``."""
    if not 0 < bubble < 1:
        raise ValueError(f"bubble is a fraction in (0, 1), got {bubble}")
    m = 1
    while bubble_fraction(stages, m) > bubble:
        m += 1
    return m


def pipelined_step_ms(stage_ms: list[float], micro_batches: int) -> float:
    """Exercise 2: a pipelined step from each stage's time on one micro-batch (one call)."""
    return pipeline_ms(stage_ms, micro_batches)
