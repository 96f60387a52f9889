"""Model parallelism measured in one run: single device, naive split, pipelined for each m.

    python -m tutorial_utils.bench_model_parallel --model wrn-28-10 --batch 256 \\
        --micro-batches 1 2 4 8 16 32

Times forward + backward of one batch (bf16 autocast, channels_last, cuDNN autotuning; no
optimizer step) on one device, split across devices naively, and pipelined with m
micro-batches. The prediction for the pipeline is
:func:`~tutorial_utils.parallel.model_parallel.pipeline_ms` of the stages timed alone on one
micro-batch, t_s(b/m): for p equal stages the bubble model (m+p-1) t(b/m), with t(b/m)
measured, so it includes the fixed cost per micro-batch (launches, copies) that makes large m
stop paying.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .devices import devices_for
from .models import wide_resnet
from .parallel.model_parallel import (
    ModelParallel,
    PipelinedModelParallel,
    balanced_boundaries,
    bubble_fraction,
    forward_flops,
    pipeline_ms,
    split_sequential,
)
from .report import legend_outside
from .timing import benchmark
from .workload import cudnn_autotuning


@dataclass
class PipelineRow:
    name: str
    micro_batches: int | None
    measured_ms: float
    predicted_ms: float | None = None

    def speedup_over(self, naive_ms: float) -> float:
        return naive_ms / self.measured_ms


def _fwd_bwd(model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    def step() -> None:
        with _autocast(x.device):
            out = model(x)  # on the last stage's device when the model is split
            loss = F.cross_entropy(out, y.to(out.device))
        loss.backward()
        model.zero_grad(set_to_none=True)
    return step


def stage_times_ms(stages: nn.ModuleList, devices: list[torch.device], x: torch.Tensor,
                   repeats: int) -> list[float]:
    """Forward + backward of each stage alone on input ``x`` (its real activations)."""
    times, h = [], x
    for stage, dev in zip(stages, devices, strict=True):
        inp = h.detach().to(dev).requires_grad_(h is not x)
        times.append(benchmark(_stage_step(stage, inp), warmup=2, repeats=repeats,
                               device=dev).median_ms)
        with torch.no_grad(), _autocast(dev):
            h = stage(inp)
    return times


def _autocast(dev: torch.device):
    return torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")


def _stage_step(stage: nn.Module, inp: torch.Tensor):
    def step() -> None:
        with _autocast(inp.device):
            out = stage(inp)
        out.float().sum().backward()
        stage.zero_grad(set_to_none=True)
    return step


# cuDNN times its algorithms for each new shape (each micro-batch size) during the warm-up
# steps, as the torchrun stages of workers/pipeline_stage.py do: both pipelines run alike.
@cudnn_autotuning()
def run(model_name: str, batch: int, micro_batches: list[int], n_devices: int = 2,
        repeats: int = 10) -> tuple[list[PipelineRow], list[torch.device]]:
    devices = devices_for(n_devices)
    torch.manual_seed(0)
    base = wide_resnet(model_name).to(memory_format=torch.channels_last)
    x = torch.randn(batch, 3, 32, 32).to(devices[0], memory_format=torch.channels_last)
    y = torch.randint(0, 10, (batch,), device=devices[0])
    # Stages of equal arithmetic, not equal parameter counts (see forward_flops).
    starts = balanced_boundaries(base, n_devices, forward_flops(base, torch.randn(2, 3, 32, 32)))
    one = copy.deepcopy(base).to(devices[0])
    rows = [PipelineRow("1 device", None, _timed(one, x, y, devices[:1], repeats))]
    naive = ModelParallel(copy.deepcopy(base), devices, starts)
    rows.append(PipelineRow(f"naive split, {n_devices} devices", 1,
                            _timed(naive, x, y, devices, repeats)))
    stages = split_sequential(copy.deepcopy(base), devices, starts)
    for m in micro_batches:
        predicted = pipeline_ms(stage_times_ms(stages, devices, x[: batch // m], repeats), m)
        pipe = PipelinedModelParallel(copy.deepcopy(base), devices, micro_batches=m,
                                      starts=starts)
        rows.append(PipelineRow(f"pipelined, m={m}", m, _timed(pipe, x, y, devices, repeats),
                                predicted))
    return rows, devices


def _timed(model: nn.Module, x, y, devices, repeats: int) -> float:
    """Median ms of a step spanning several devices: CUDA events on one device would miss the
    work of the others (backward ends on the first), so wait for all of them around each."""
    step = _fwd_bwd(model, x, y)

    def sync_all() -> None:
        for d in {d for d in devices if d.type == "cuda"}:
            torch.cuda.synchronize(d)

    for _ in range(2):
        step()
    samples = []
    for _ in range(repeats):
        sync_all()
        t0 = time.perf_counter()
        step()
        sync_all()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def table(rows: list[PipelineRow], stages: int) -> str:
    naive = rows[1].measured_ms
    lines = [f"{'run':<28}{'ms':>9}{'vs naive':>10}{'predicted':>11}{'error':>8}{'bubble':>8}"]
    for r in rows:
        pred = f"{r.predicted_ms:>11.2f}" if r.predicted_ms else f"{'':>11}"
        err = f"{r.measured_ms / r.predicted_ms - 1:>+8.1%}" if r.predicted_ms else f"{'':>8}"
        bub = f"{bubble_fraction(stages, r.micro_batches):>8.1%}" if r.micro_batches else ""
        lines.append(f"{r.name:<28}{r.measured_ms:>9.2f}{r.speedup_over(naive):>9.2f}x"
                     f"{pred}{err}{bub}")
    return "\n".join(lines)


def plot(rows: list[PipelineRow], stages: int, title: str):
    """Speed-up over the naive split against m: measured, predicted, and the bare bubble model."""
    import matplotlib.pyplot as plt

    naive = rows[1].measured_ms
    piped = [r for r in rows if r.predicted_ms]
    m = [r.micro_batches for r in piped]
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    # Equal stages and no cost per micro-batch: p t against (m+p-1) t/m.
    ax.plot(m, [stages * k / (k + stages - 1) for k in m], "k:", label="bubble model alone")
    ax.plot(m, [naive / r.predicted_ms for r in piped], "s--", color="#dd8452",
            label="predicted from stage times")
    ax.plot(m, [naive / r.measured_ms for r in piped], "o-", color="#4c72b0", label="measured")
    ax.axhline(naive / rows[0].measured_ms, color="grey", lw=1, label="one device")
    ax.set_xscale("log", base=2)
    ax.set_xticks(m, [str(k) for k in m])
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("speed-up over the naive split")
    ax.set_title(title, fontsize=9)
    legend_outside(ax)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="wrn-28-10")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    rows, devices = run(args.model, args.batch, args.micro_batches, args.devices, args.repeats)
    print(f"{args.model.upper()}, batch {args.batch}, devices {[str(d) for d in devices]}")
    print(table(rows, args.devices))


if __name__ == "__main__":
    main()
