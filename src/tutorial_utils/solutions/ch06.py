"""Solutions to the exercises of chapter 6, "Beyond one machine"."""

from __future__ import annotations

from ..memory import STAGES, bytes_per_param


def zero_gb_per_gpu(n_params: float, world_size: int, optimizer: str = "adam",
                    precision: str = "mixed") -> dict[str, float]:
    """Exercise 1: GB per GPU of the model state under DDP and each ZeRO stage."""
    return {stage: bytes_per_param(optimizer, precision, stage, world_size) * n_params / 1e9
            for stage in STAGES}


def resume_point(crash_step: int, steps_per_epoch: int) -> tuple[int, int]:
    """Exercise 2: (epoch a restarted job resumes at, counted from 1 as the training log counts
    them; steps it trains again) after a crash at global step ``crash_step`` (counted from 0)
    when a checkpoint is written after every epoch."""
    done = crash_step // steps_per_epoch  # epochs whose checkpoint was written
    return done + 1, crash_step - done * steps_per_epoch
