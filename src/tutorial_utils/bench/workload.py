"""What the benchmarks time: one training step of a Wide-ResNet on a fixed batch.

Chapter 2's ladder, chapter 4's DataParallel/DDP comparison and chapter 5b's scaling benchmark
all time the same step (forward, loss, backward, SGD update:
:func:`tutorial_utils.step.train_step`), so they build it here: :func:`make_train_step` in
this process for each :class:`Rung` of optimisations, :func:`time_data_parallel` with
``nn.DataParallel``, and :func:`time_ddp` in N processes under torchrun
(:mod:`tutorial_utils.bench.workers.step_timing`, configured by a :class:`StepTimingConfig`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..config import Config, check, check_wrn, opt
from ..models.wrn import wide_resnet
from ..parallel.data_parallel import make_data_parallel
from ..step import train_step
from ..timing import (
    benchmark,
    cold_call_ms,
    cudnn_autotuning,
    host_clock_without_sync,
    synchronize,
    tf32_enabled,
)


@dataclass
class Workload(Config):
    """One training step of a Wide-ResNet on a fixed random batch, timed after a warm-up."""

    model: str = opt("wrn-28-10", "the network, WRN-depth-width")
    batch: int = opt(128, "images per step (per process under DDP)")
    warmup: int = opt(5, "untimed steps first")
    repeats: int = opt(20, "timed steps; the median is reported")

    def __post_init__(self) -> None:
        check_wrn(self.model)
        check((self.batch >= 1, f"--batch must be >= 1, got {self.batch}"),
              (self.warmup >= 0, f"--warmup must be >= 0, got {self.warmup}"),
              (self.repeats >= 1, f"--repeats must be >= 1, got {self.repeats}"))


@dataclass(frozen=True)
class Rung:
    name: str
    tf32: bool = False
    bf16: bool = False
    channels_last: bool = False
    compile_mode: str | None = None  # a torch.compile mode; None runs eagerly
    gpu_only: str | None = None  # why the rung measures nothing new without a GPU


LADDER: tuple[Rung, ...] = (
    Rung("fp32"),
    Rung("tf32", tf32=True, gpu_only="TF32 is a GPU tensor-core format; a CPU computes FP32"),
    Rung("bf16 autocast", tf32=True, bf16=True),
    Rung("+ channels_last", tf32=True, bf16=True, channels_last=True),
    Rung("+ torch.compile", tf32=True, bf16=True, channels_last=True, compile_mode="default"),
    Rung("+ CUDA graphs", tf32=True, bf16=True, channels_last=True,
         compile_mode="reduce-overhead",
         gpu_only="CUDA graphs record GPU kernel launches; a CPU has none to record"),
)


@dataclass(frozen=True)
class RungResult:
    """One rung timed: a row of chapter 2's ladder (and of its record)."""

    rung: str  # the Rung's name
    batch: int
    ms: float | None = None  # median step time
    spread: float | None = None  # interquartile range over the median
    host_ms: float | None = None  # time for the host to queue one step (no synchronisation)
    first_ms: float | None = None  # the first, cold step
    skipped: str | None = None  # why it was not measured here

    @property
    def images_per_s(self) -> float | None:
        return None if self.ms is None else self.batch / self.ms * 1e3


def skip_reason(rung: Rung, device: torch.device) -> str | None:
    """Why a rung is not measured on this device, or None."""
    if device.type != "cuda" and rung.gpu_only:
        return rung.gpu_only
    return None


@dataclass
class TrainStep:
    """One SGD training step on a fixed batch; call it to run the step."""

    model: nn.Module
    forward: Callable[[torch.Tensor], torch.Tensor]  # the model, or its compiled version
    optimizer: torch.optim.Optimizer
    x: torch.Tensor
    y: torch.Tensor
    bf16: bool

    def __call__(self) -> torch.Tensor:
        return train_step(self.forward, self.optimizer, self.x, self.y,
                          "bf16" if self.bf16 else "fp32")


def make_train_step(rung: Rung, size: Workload, device: torch.device) -> TrainStep:
    """Build model, optimizer and one fixed random batch for ``rung``."""
    torch.manual_seed(0)
    memory_format = torch.channels_last if rung.channels_last else torch.contiguous_format
    model = wide_resnet(size.model).to(device, memory_format=memory_format)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    x = torch.randn(size.batch, 3, 32, 32, device=device).to(memory_format=memory_format)
    y = torch.randint(0, 10, (size.batch,), device=device)
    forward = torch.compile(model, mode=rung.compile_mode) if rung.compile_mode else model
    return TrainStep(model, forward, optimizer, x, y, rung.bf16)


def measure_rung(rung: Rung, size: Workload, device: torch.device) -> RungResult:
    reason = skip_reason(rung, device)
    if reason:
        return RungResult(rung.name, size.batch, skipped=reason)
    # cuDNN autotuning on: the shapes never change (every benchmark times it that way)
    with tf32_enabled(rung.tf32), cudnn_autotuning():
        step = make_train_step(rung, size, device)
        first = cold_call_ms(step, device)  # includes cuDNN autotuning and any compilation
        timing = benchmark(step, warmup=size.warmup, repeats=size.repeats, device=device)
        host = host_clock_without_sync(step, repeats=3)
        synchronize(device)
    return RungResult(rung.name, size.batch, timing.median_ms, timing.spread, host.median_ms,
                      first)


def time_data_parallel(size: Workload, n_gpus: int, cudnn_benchmark: bool) -> float:
    """Median step time (ms) of ``nn.DataParallel`` over ``n_gpus`` at ``size.batch`` per GPU.

    With autotuning on, a step can take many times longer, so fewer repeats are timed.
    """
    with cudnn_autotuning(cudnn_benchmark):
        torch.manual_seed(0)
        net = wide_resnet(size.model).to(memory_format=torch.channels_last)
        model = make_data_parallel(net, n_gpus)
        dev = torch.device("cuda:0")
        x = torch.randn(size.batch * n_gpus, 3, 32, 32, device=dev)
        y = torch.randint(0, 10, (size.batch * n_gpus,), device=dev)
        opt_ = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True)
        step = TrainStep(model, model, opt_, x.to(memory_format=torch.channels_last), y, True)
        warmup, repeats = (1, 5) if cudnn_benchmark else (size.warmup, size.repeats)
        return benchmark(step, warmup=warmup, repeats=repeats, device=dev).median_ms
