"""Solutions to the exercises of chapter 5, "The Wide-ResNet experiment"."""

from __future__ import annotations


def epoch_seconds(step_ms: float, global_batch: int, images: int = 50_000) -> float:
    """Exercise 1: an epoch's training time predicted from one step's time (the last,
    incomplete batch of an epoch is dropped, as the training entry point does)."""
    return images // global_batch * step_ms / 1e3


def wall_clock_speedup(reference_s: float, train_s: float, setup_s: float) -> float:
    """Exercise 2: a speed-up whose clock also counts the faster run's set-up."""
    return reference_s / (train_s + setup_s)
