"""Pipelining across processes with ``torch.distributed.pipelining``: one stage per process.

:class:`~tutorial_utils.parallel.model_parallel.PipelinedModelParallel` shows the mechanism in
one process; this is the route to use in practice, under ``torchrun`` (see
:mod:`tutorial_utils.workers.pipeline_stage`). Each process

1. builds only its own stage (:func:`build_stage`): the whole model is constructed on the
   ``meta`` device (shapes, no memory), cut at boundaries of equal forward FLOPs, and only this
   rank's layers are allocated and initialised. A model worth pipelining does not fit on one
   device, so no process may build all of it first;
2. picks a schedule (:data:`SCHEDULES`): GPipe runs all forwards, then all backwards; 1F1B
   alternates once the pipeline is full, so it holds fewer micro-batches of activations;
3. runs :func:`train_step`, where only the first stage gets inputs and only the last targets.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from .model_parallel import balanced_boundaries, forward_flops

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def small_net() -> nn.Sequential:
    """Seven layers without BatchNorm: micro-batches then give exactly the batch's gradients."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, stride=2, padding=1),
        nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
    )


def stage_bounds(make: Callable[[], nn.Sequential], n_stages: int,
                 sample_shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """``[start, end)`` layer indices of each stage, balanced by forward FLOPs."""
    with torch.device("meta"):  # FLOPs follow from shapes: nothing is allocated
        model = make()
        costs = forward_flops(model, torch.empty(sample_shape))
    starts = balanced_boundaries(model, n_stages, costs)
    return list(zip(starts, [*starts[1:], len(model)], strict=True))


def materialise(make: Callable[[], nn.Sequential], start: int, end: int | None,
                device: torch.device,
                init: Callable[[nn.Module], None] | None = None, seed: int = 0) -> list[nn.Module]:
    """Layers ``start..end-1`` of ``make()`` (``end=None``: to the last), allocated on
    ``device`` only and initialised.

    Layer i is initialised from seed ``seed + i``: it gets the same weights whichever rank
    builds it and whether or not the other layers exist, so a one-process reference built
    the same way has the pipeline's weights. ``init`` (applied after ``reset_parameters``)
    is the model's own initialisation rule, if it has one.
    """
    with torch.device("meta"):
        layers = list(make())[start:end]
    devices = [device] if device.type == "cuda" else []
    for i, layer in enumerate(layers, start):
        layer.to_empty(device=device)  # uninitialised memory: every tensor is set below
        with torch.random.fork_rng(devices=devices):  # leave the caller's random stream alone
            torch.manual_seed(seed + i)
            for m in layer.modules():
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()  # BatchNorm's also resets its running statistics
                if init is not None:
                    init(m)
    return layers


class StageModule(nn.Module):
    """Consecutive layers run the way the in-process pipeline runs them.

    bf16 autocast (when asked) stays inside the stage, so backward runs outside it. The output
    is made contiguous because ``torch.distributed`` sends only contiguous tensors, and a
    channels_last activation is not (``input tensor has to be contiguous``).
    """

    def __init__(self, layers: list[nn.Module], bf16: bool = False) -> None:
        super().__init__()
        self.layers = nn.Sequential(*layers)
        self.bf16 = bf16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            return self.layers(x).contiguous()


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy in fp32, as autocast computes it (the logits may arrive in bf16)."""
    return F.cross_entropy(logits.float(), target)


def build_stage(make: Callable[[], nn.Sequential], rank: int, n_stages: int,
                device: torch.device, sample_shape: tuple[int, ...], *, bf16: bool = False,
                channels_last: bool = False, init: Callable[[nn.Module], None] | None = None,
                ) -> tuple[PipelineStage, range]:
    """This rank's ``PipelineStage`` and the indices of the layers it holds (nothing else)."""
    start, end = stage_bounds(make, n_stages, sample_shape)[rank]
    module = StageModule(materialise(make, start, end, device, init), bf16)
    if channels_last:
        module.to(memory_format=torch.channels_last)  # 4-D weights only
    return PipelineStage(module, rank, n_stages, device), range(start, end)


def make_schedule(stage: PipelineStage, name: str, micro_batches: int):
    """A GPipe or 1F1B schedule over ``micro_batches`` equal chunks of each batch."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {name!r}")
    return SCHEDULES[name](stage, micro_batches, loss_fn=loss_fn)


def train_step(schedule, stage: PipelineStage, x: torch.Tensor, y: torch.Tensor,
               optimizer: torch.optim.Optimizer | None = None) -> list[torch.Tensor]:
    """Forward and backward of one batch through all stages (and an update, if asked).

    Every rank calls it with the same batch; only the first stage reads ``x`` and only the
    last reads ``y``, the others receive activations and gradients from their neighbours.
    Returns the last stage's loss per micro-batch (empty elsewhere).
    """
    stage.submod.zero_grad(set_to_none=True)
    losses: list[torch.Tensor] = []
    inputs = (x,) if stage.is_first else ()
    labels = {"target": y, "losses": losses} if stage.is_last else {}
    schedule.step(*inputs, **labels)
    if optimizer is not None:
        optimizer.step()
    return losses

