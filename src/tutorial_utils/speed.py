"""Chapter 2's measurements: host-to-GPU copies and the single-GPU speed ladder.

The ladder times one full training step (forward, loss, backward, SGD update) of a
Wide-ResNet, adding one optimisation per rung: TF32 matmuls/convs, bf16 autocast,
channels_last memory format, torch.compile, and CUDA graphs. Each rung also records how long
the host takes just to *queue* a step: when that approaches the step time, the GPU is waiting
for Python and only fewer launches (fusion, CUDA graphs) make it faster.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .models import wide_resnet
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
    with tf32_enabled(rung.tf32):
        step = make_train_step(rung, size, device)
        first = cold_call_ms(step, device)  # includes cuDNN autotuning and any compilation
        timing = benchmark(step, warmup=size.warmup, repeats=size.repeats, device=device)
        host = host_clock_without_sync(step, repeats=3)
        synchronize(device)
    return RungResult(rung, timing, size.batch, first_step_ms=first, host_ms=host.median_ms)


def measure_ladder(
    size: LadderSize, device: torch.device, rungs: tuple[Rung, ...] = LADDER
) -> list[RungResult]:
    """Measure every rung in order; cuDNN autotuning is on (the shapes never change)."""
    old_benchmark = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    try:
        return [measure_rung(r, size, device) for r in rungs]
    finally:
        torch.backends.cudnn.benchmark = old_benchmark


def host_to_device_gbps(
    nbytes: int, device: torch.device, pinned: bool, repeats: int = 10
) -> float | None:
    """Copy bandwidth from host memory to ``device`` in GB/s (None on the CPU)."""
    if device.type != "cuda":
        return None
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    timing = benchmark(
        lambda: host.to(device, non_blocking=pinned), warmup=2, repeats=repeats, device=device
    )
    return nbytes / timing.median_ms / 1e6



def ladder_table(results: list[RungResult]) -> str:
    """Rung, median step time and spread, host queueing time, images/s, speed-up over rung 1."""
    base = results[0].timing.median_ms if results[0].timing else None
    header = f"{'rung':<18}{'step (ms)':>11}{'IQR':>7}{'queue (ms)':>12}{'images/s':>10}"
    lines = [header + f"{'speed-up':>10}"]
    for r in results:
        if r.timing is None:
            lines.append(f"{r.rung.name:<18}  skipped: {r.skipped}")
            continue
        speedup = f"{base / r.timing.median_ms:.2f}x" if base else "-"
        lines.append(
            f"{r.rung.name:<18}{r.timing.median_ms:>11.2f}{r.timing.spread:>7.1%}"
            f"{r.host_ms:>12.2f}{r.images_per_s:>10.0f}{speedup:>10}"
        )
    return "\n".join(lines)


def plot_ladder(results: list[RungResult], title: str):
    """Bar chart of images/s per rung, each bar labelled with its speed-up over the first."""
    import matplotlib.pyplot as plt

    measured = [r for r in results if r.timing is not None]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    names = [r.rung.name for r in measured]
    rates = [r.images_per_s for r in measured]
    bars = ax.bar(names, rates, color="#4c72b0")
    for bar, rate in zip(bars, rates, strict=True):
        ax.annotate(f"{rate / rates[0]:.2f}x", (bar.get_x() + bar.get_width() / 2, rate),
                    ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("training images / s")
    ax.set_title(title, fontsize=10)
    ax.margins(y=0.15)
    fig.tight_layout()
    return fig


def step_tflop(size: LadderSize, device: torch.device) -> float:
    """Floating-point operations of one training step (forward + backward), in TFLOP."""
    from torch.utils.flop_counter import FlopCounterMode

    step = make_train_step(LADDER[0], size, device)
    with FlopCounterMode(display=False) as counter:
        step()
    return counter.get_total_flops() / 1e12
