"""Solutions to the exercises of chapter 5e, "What a larger batch costs"."""

from __future__ import annotations

import dataclasses

from ..bench.experiment import with_batch
from ..trainer import TrainConfig


def peak_rates(cfg: TrainConfig, batch: int = 2048) -> dict[str, float]:
    """Exercise 1: the peak learning rate of each rule at ``batch``, on one process."""
    return {rule: with_batch(cfg, batch, rule).peak_lr(1) for rule in ("linear", "sqrt")}


def steps_per_run(images: int, batch: int, epochs: int) -> int:
    """Exercise 2: optimizer steps of a run that drops the last, incomplete batch of an epoch."""
    return images // batch * epochs


def longer_warm_up(base: TrainConfig, batch: int = 1024, warmup_epochs: float = 5) -> TrainConfig:
    """Exercise 3: the linear rule at ``batch`` with a longer warm-up; train it with
    ``bench.experiment.train(1, cfg)``."""
    return dataclasses.replace(with_batch(base, batch, "linear"), warmup_epochs=warmup_epochs)
