"""Solutions to the exercises of chapter 5b, "The scaling benchmark".

Exercise 2 is chapter 4's model: :func:`tutorial_utils.solutions.ch04.weak_scaling_prediction`;
exercise 3 is :func:`tutorial_utils.bench.timeline.overlap`, which the chapter also calls.
"""

from __future__ import annotations

from ..bench.scaling import Run, best_run


def strong_ceiling(runs: list[Run], global_batch: int, n: int) -> float:
    """Exercise 1: the strong-scaling speed-up of ``n`` GPUs if communication were free.

    Each GPU would take the best single-GPU step at ``global_batch // n`` images, and one GPU
    takes its best step at ``global_batch``: the ratio of the two is the ceiling.
    """
    whole = best_run(runs, "single", "1 GPU", batch=global_batch)
    part = best_run(runs, "single", "1 GPU", batch=global_batch // n)
    if whole is None or part is None:
        raise ValueError(f"needs single-GPU runs at {global_batch} and {global_batch // n} images")
    return whole.step_ms / part.step_ms
