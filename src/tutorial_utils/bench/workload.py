"""What the benchmarks time: one training step of a Wide-ResNet on a fixed batch.

Chapter 2's ladder, chapter 4's DataParallel/DDP comparison and chapter 5b's scaling benchmark
all time the same step (forward, loss, backward, SGD update), so they build it here:
:func:`make_train_step` in this process for each :class:`Rung` of optimisations,
:func:`time_data_parallel` with ``nn.DataParallel``, and :func:`time_ddp` in N processes under
torchrun (:mod:`tutorial_utils.workers.step_timing`).
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .launch import torchrun
from .models import wide_resnet
from .parallel.data_parallel import make_data_parallel
from .timing import Timing, benchmark, cold_call_ms, host_clock_without_sync, synchronize


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
    Rung(
        "+ CUDA graphs",
        tf32=True,
        bf16=True,
        channels_last=True,
        compile_mode="reduce-overhead",
        gpu_only="CUDA graphs record GPU kernel launches; a CPU has none to record",
    ),
)


@dataclass(frozen=True)
class LadderSize:
    model: str
    batch: int
    warmup: int
    repeats: int


@dataclass(frozen=True)
class RungResult:
    rung: Rung
    timing: Timing | None
    batch: int
    first_step_ms: float | None = None
    host_ms: float | None = None  # time for the host to queue one step (no synchronisation)
    skipped: str | None = None

    @property
    def images_per_s(self) -> float | None:
        return None if self.timing is None else self.batch / self.timing.median_ms * 1e3


@contextlib.contextmanager
def tf32_enabled(enabled: bool) -> Iterator[None]:
    """Allow (or forbid) TF32 in matmuls and cuDNN convolutions, restoring the old settings.

    cuDNN convolutions default to TF32 already, so a true FP32 baseline must switch it off.
    """
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def skip_reason(rung: Rung, device: torch.device) -> str | None:
    """Why a rung is not measured on this device, or None."""
    if device.type != "cuda" and rung.gpu_only:
        return rung.gpu_only
    return None


@dataclass
class TrainStep:
    """One SGD training step on a fixed batch; call it to run the step."""

    model: nn.Module
    forward: Callable[[torch.Tensor], torch.Tensor]
    optimizer: torch.optim.Optimizer
    x: torch.Tensor
    y: torch.Tensor
    bf16: bool

    def __call__(self) -> None:
        with torch.autocast(self.x.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            loss = F.cross_entropy(self.forward(self.x), self.y)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def loss(self) -> float:
        with torch.autocast(self.x.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            return float(F.cross_entropy(self.model(self.x), self.y))


def make_train_step(rung: Rung, size: LadderSize, device: torch.device) -> TrainStep:
    """Build model, optimizer and one fixed random batch for ``rung``."""
    torch.manual_seed(0)
    memory_format = torch.channels_last if rung.channels_last else torch.contiguous_format
    model = wide_resnet(size.model).to(device, memory_format=memory_format)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    x = torch.randn(size.batch, 3, 32, 32, device=device).to(memory_format=memory_format)
    y = torch.randint(0, 10, (size.batch,), device=device)
    forward = torch.compile(model, mode=rung.compile_mode) if rung.compile_mode else model
    return TrainStep(model, forward, optimizer, x, y, rung.bf16)


def measure_rung(rung: Rung, size: LadderSize, device: torch.device) -> RungResult:
    reason = skip_reason(rung, device)
    if reason:
        return RungResult(rung, None, size.batch, skipped=reason)
    # cuDNN autotuning on: the shapes never change (every benchmark times it that way)
    with tf32_enabled(rung.tf32), cudnn_autotuning():
        step = make_train_step(rung, size, device)
        first = cold_call_ms(step, device)  # includes cuDNN autotuning and any compilation
        timing = benchmark(step, warmup=size.warmup, repeats=size.repeats, device=device)
        host = host_clock_without_sync(step, repeats=3)
        synchronize(device)
    return RungResult(rung, timing, size.batch, first_step_ms=first, host_ms=host.median_ms)


@contextlib.contextmanager
def cudnn_autotuning(enabled: bool = True) -> Iterator[None]:
    """Let cuDNN time its algorithms for each new shape (``cudnn.benchmark``), then restore."""
    old = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = enabled
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = old


def time_data_parallel(size: LadderSize, n_gpus: int, cudnn_benchmark: bool) -> float:
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
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True)
        step = TrainStep(model, model, opt, x.to(memory_format=torch.channels_last), y, bf16=True)
        warmup, repeats = (1, 5) if cudnn_benchmark else (size.warmup, size.repeats)
        return benchmark(step, warmup=warmup, repeats=repeats, device=dev).median_ms


def time_ddp(size: LadderSize, n: int, device: str, compile_mode: str = "none",
             capture: bool = False, timeout_s: float = 900, trace: Path | None = None) -> dict:
    """The record of :mod:`~tutorial_utils.workers.step_timing` run in ``n`` processes.

    ``capture`` records the whole step as one CUDA graph, with fused SGD as in ``train.py``;
    with ``trace``, rank 0 also profiles a few steps and writes their Chrome trace there.
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ddp.jsonl"
        args = ["--model", size.model, "--batch", str(size.batch), "--warmup", str(size.warmup),
                "--repeats", str(size.repeats), "--device", device, "--compile", compile_mode,
                "--out", str(out)]
        if capture:
            args += ["--capture", "--optimizer", "fused"]
        if trace is not None:
            args += ["--trace", str(trace)]
        result = torchrun("tutorial_utils.workers.step_timing", args, nproc=n,
                          timeout_s=timeout_s, metrics_file=out, echo=False)
    return result.metrics[0]
