"""Model parallelism: consecutive layers on different devices, naive and pipelined.

:class:`ModelParallel` is the Torch7 post's ``withDevice`` idea: stage i lives on device i and
the whole batch hops from device to device, so only one device works at a time.
:class:`PipelinedModelParallel` cuts the batch into m micro-batches and issues them so that
stage s runs micro-batch j while stage s+1 runs micro-batch j-1 (GPipe's fill and drain).
CUDA kernels are asynchronous and each device has its own queue, so the devices overlap
without any host synchronisation; backward overlaps too, because autograd runs one thread per
device. With p equal stages the idle share of each device, the *bubble*, is (p-1)/(m+p-1).

In practice, across processes or machines, use ``torch.distributed.pipelining`` (one stage
per process, GPipe or 1F1B schedules): see :mod:`tutorial_utils.parallel.pipeline`.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn


def forward_flops(model: nn.Sequential, sample: torch.Tensor) -> list[float]:
    """Forward FLOPs of each layer on ``sample`` (they scale with the batch, so a small one does).

    Balancing stages by FLOPs rather than parameters matters for CNNs: a Wide-ResNet's last
    group holds most of the parameters but only about a third of the arithmetic.
    """
    from torch.utils.flop_counter import FlopCounterMode

    costs, h = [], sample
    with torch.no_grad():
        for layer in model:
            with FlopCounterMode(display=False) as counter:
                h = layer(h)
            costs.append(float(counter.get_total_flops()))
    return costs


def balanced_boundaries(
    model: nn.Sequential, n_stages: int, costs: list[float] | None = None
) -> list[int]:
    """Indices where stages start, balancing ``costs`` per layer (default: parameter counts).

    Layers stay whole and in order; every stage gets at least one layer.
    """
    if not 1 <= n_stages <= len(model):
        raise ValueError(f"need 1..{len(model)} stages for {len(model)} layers, got {n_stages}")
    sizes = costs or [sum(p.numel() for p in layer.parameters()) for layer in model]
    prefix = list(itertools.accumulate(sizes))  # prefix[i]: cost of layers 0..i
    starts = [0]
    for k in range(1, n_stages):
        target = prefix[-1] * k / n_stages
        first = starts[-1] + 1  # the previous stage keeps at least one layer
        last = len(sizes) - (n_stages - k)  # and each later stage gets one
        starts.append(min(range(first, last + 1), key=lambda b: abs(prefix[b - 1] - target)))
    return starts


def split_sequential(
    model: nn.Sequential, devices: list[torch.device], starts: list[int] | None = None
) -> nn.ModuleList:
    """Cut ``model`` into ``len(devices)`` consecutive stages and move stage i to devices[i]."""
    starts = starts or balanced_boundaries(model, len(devices))
    ends = [*starts[1:], len(model)]
    layers = list(model)  # slicing a Sequential subclass would call the subclass's constructor
    return nn.ModuleList(
        nn.Sequential(*layers[a:b]).to(dev) for a, b, dev in zip(starts, ends, devices, strict=True)
    )


class ModelParallel(nn.Module):
    """Naive split: the batch passes through the stages one device after another."""

    def __init__(self, model: nn.Sequential, devices: list[torch.device],
                 starts: list[int] | None = None) -> None:
        super().__init__()
        self.devices = list(devices)
        self.stages = split_sequential(model, self.devices, starts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage, dev in zip(self.stages, self.devices, strict=True):
            x = stage(x.to(dev, non_blocking=True))
        return x


class PipelinedModelParallel(ModelParallel):
    """GPipe-style fill/drain over ``micro_batches`` chunks of the batch, in one process."""

    def __init__(self, model: nn.Sequential, devices: list[torch.device], micro_batches: int,
                 starts: list[int] | None = None) -> None:
        super().__init__(model, devices, starts)
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        self.micro_batches = micro_batches

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chunks = list(x.chunk(self.micro_batches))
        p, m = len(self.stages), len(chunks)
        # Clock tick t: stage s works on micro-batch t - s. Later stages are issued first
        # within a tick, so no stage waits for work queued behind its successor's input.
        for t in range(m + p - 1):
            for s in reversed(range(p)):
                j = t - s
                if 0 <= j < m:
                    chunks[j] = self.stages[s](chunks[j].to(self.devices[s], non_blocking=True))
        return torch.cat(chunks)


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """Share of time each device idles in a GPipe fill/drain: (p-1)/(m+p-1)."""
    return (stages - 1) / (micro_batches + stages - 1)


def pipeline_ms(stage_ms: list[float], micro_batches: int) -> float:
    """Fill/drain step time from each stage's time on one micro-batch.

    The first micro-batch passes every stage; the other m-1 follow at the pace of the
    slowest one: sum_s t_s + (m-1) max_s t_s. For p equal stages that is (m+p-1) t.
    """
    return sum(stage_ms) + (micro_batches - 1) * max(stage_ms)
