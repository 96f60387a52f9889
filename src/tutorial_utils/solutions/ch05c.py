"""Solutions to the exercises of chapter 5c, "Where the memory goes"."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..bench.memory import build, release
from ..memory import BYTES_PER_PARAM, STAGES, Breakdown, Checkpointed, breakdown
from ..timing import cudnn_autotuning


def adam_breakdown(model_name: str, batch: int, device="cpu") -> Breakdown:
    """Exercise 1: the breakdown with Adam in place of SGD with momentum.

    Adam keeps two moments per parameter (8 bytes in FP32) where momentum keeps one (4), and
    a step count per tensor, which PyTorch keeps on the CPU unless ``capturable`` or ``fused``.
    """
    with cudnn_autotuning():
        release(device)
        model, _, data = build(model_name, batch, device)
        out = breakdown(model, torch.optim.Adam(model.parameters(), lr=1e-3), data,
                        name=model_name)
    release(device)
    return out


def gpus_needed(n_params: int, budget_bytes: float, optimizer: str = "adam",
                precision: str = "mixed", stage: str = "ZeRO-3") -> int | None:
    """Exercise 2: the fewest GPUs whose share of the model state fits in ``budget_bytes``.

    A stage keeps some parts whole on every rank and divides the rest by N; None when the
    whole parts alone exceed the budget, so that no number of GPUs is enough.
    """
    parts = BYTES_PER_PARAM[(optimizer, precision)]
    k = STAGES.index(stage)  # ZeRO-k shards the last k of (weights, gradients, state)
    whole, sharded = sum(parts[:3 - k]) * n_params, sum(parts[3 - k:]) * n_params
    if whole > budget_bytes or (sharded and whole == budget_bytes):
        return None
    return max(1, math.ceil(sharded / (budget_bytes - whole))) if sharded else 1


@contextlib.contextmanager
def frozen_batchnorm(module: nn.Module) -> Iterator[None]:
    """BatchNorm layers of ``module`` leave their running statistics alone inside the block.

    Momentum 0 makes the update ``(1 - 0) * running + 0 * batch``: the statistics stay as
    they are, while the layer still normalises with the batch's own mean and variance.
    """
    norms = [m for m in module.modules() if isinstance(m, nn.BatchNorm2d)]
    saved = [(m.momentum, m.num_batches_tracked.clone()) for m in norms]
    for m in norms:
        m.momentum = 0.0
    try:
        yield
    finally:
        for m, (momentum, count) in zip(norms, saved, strict=True):
            m.momentum = momentum
            m.num_batches_tracked.copy_(count)


class CheckpointedOnce(Checkpointed):
    """Exercise 3: checkpointed blocks whose recomputation leaves BatchNorm's statistics alone."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.blocks, x, use_reentrant=False,
                          context_fn=lambda: (contextlib.nullcontext(),
                                              frozen_batchnorm(self.blocks)))
