"""Solutions to the exercises of chapter 2, "One GPU"."""

from __future__ import annotations

from ..bench.one_gpu import break_even_steps
from ..bench.workload import RungResult


def graphs_break_even(results: list[RungResult]) -> float:
    """Exercise 1: steps after which the CUDA-graphs rung's slow first step has paid for itself
    against the eager channels_last rung, from the ladder's results."""
    eager, graphs = results[3], results[-1]
    return break_even_steps(graphs.first_ms, eager.ms, graphs.ms)
