"""Run under torchrun: the production route to pipelining, one stage per process.

    torchrun --standalone --nproc_per_node=2 -m tutorial_utils.workers.pipeline_stage \\
        --model wrn-28-10 --batch 256 --micro-batches 8 --schedule 1f1b --out pipe.jsonl

Each process builds only its own stage (:mod:`tutorial_utils.parallel.pipeline`) and times
forward + backward of a batch. On GPUs it runs like chapter 3's in-process pipeline (bf16
autocast, channels_last, cuDNN autotuning), so the two compare designs, not precisions; with
``--check`` each stage's gradients are compared with those of the whole model in one process
on the whole batch, in the same precision. Rank 0 writes one JSON line.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from ..config import Config, check, check_wrn, opt, parse_or_exit
from ..jsonl import write_jsonl
from ..models.wrn import init_weights, wide_resnet
from ..parallel.distributed import DistContext, distributed
from ..parallel.pipeline import (
    StageModule,
    build_stage,
    loss_fn,
    make_schedule,
    materialise,
    small_net,
    train_step,
)
from ..timing import benchmark

SAMPLE = (3, 32, 32)  # CIFAR-shaped images


def model_maker(name: str):
    """``cnn``: :func:`small_net` (no BatchNorm, exact checks); else a WRN name, with its init."""
    if name == "cnn":
        return small_net, None
    return functools.partial(wide_resnet, name), init_weights


@dataclass
class StageRow:
    """What rank 0 writes: the pipeline that ran, its step time, and its gradient check."""

    world_size: int
    model: str
    batch: int
    micro_batches: int
    schedule: str
    precision: str
    memory_format: str
    cudnn_benchmark: bool
    params_per_rank: list[int]
    step_ms: float | None = None
    max_grad_diff: float | None = None  # with --check: against one process's gradients
    max_grad: float | None = None


@dataclass
class PipelineConfig(Config):
    """Run under torchrun: the production route to pipelining, one stage per process."""

    model: str = opt("cnn", "cnn (a small network without BatchNorm) or a WRN, wrn-28-10")
    batch: int = opt(32, "images per step, cut into micro-batches")
    micro_batches: int = opt(4, "micro-batches per step")
    schedule: Literal["gpipe", "1f1b"] = opt("gpipe", "the pipeline schedule")
    device: Literal["auto", "cpu", "cuda"] = opt("auto", "cuda needs one GPU per process")
    bf16: bool | None = opt(None, "bf16 autocast (default: on GPUs)")
    channels_last: bool | None = opt(None, "channels_last inputs and weights (default: on GPUs)")
    check: bool = opt(False, "compare each stage's gradients with one process's")
    repeats: int = opt(0, "timed steps (0: none)")
    out: Path = opt(Path("runs/pipeline.jsonl"), "rank 0 appends its JSON line here")

    def __post_init__(self) -> None:
        if self.model != "cnn":
            check_wrn(self.model)
        check((self.micro_batches >= 1, f"--micro-batches must be >= 1, got {self.micro_batches}"),
              (self.batch % self.micro_batches == 0,
               f"--batch {self.batch} is not a multiple of --micro-batches "
               f"{self.micro_batches}: every micro-batch must hold as many images"),
              (self.repeats >= 0, f"--repeats must be >= 0, got {self.repeats}"))


def all_max(ctx: DistContext, *values: float) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def grad_check(ctx: DistContext, cfg: PipelineConfig, stage_module: nn.Module, layers: range,
               x: torch.Tensor, y: torch.Tensor) -> dict:
    """Largest gradient difference from the whole model, trained in this process on the whole
    batch with the pipeline's weights (built layer by layer as the stages were)."""
    make, init = model_maker(cfg.model)
    reference = StageModule(materialise(make, 0, None, ctx.device, init), cfg.bf16)
    if cfg.channels_last:
        reference.to(memory_format=torch.channels_last)
    loss_fn(reference(x), y).backward()
    ref = [p.grad for i in layers for p in reference.layers[i].parameters()]
    mine = [p.grad for p in stage_module.parameters()]
    diff = max((float((a - b).abs().max()) for a, b in zip(mine, ref, strict=True)), default=0.0)
    scale = max((float(g.abs().max()) for g in ref), default=0.0)
    worst, largest = all_max(ctx, diff, scale)
    return {"max_grad_diff": worst, "max_grad": largest}


def params_per_rank(ctx: DistContext, module: nn.Module) -> list[int]:
    """The parameters each rank holds (one all-reduce of a vector with one entry per rank)."""
    counts = torch.zeros(ctx.world_size, dtype=torch.int64, device=ctx.device)
    counts[ctx.rank] = sum(p.numel() for p in module.parameters())
    dist.all_reduce(counts)
    return counts.tolist()


def main(argv: list[str] | None = None) -> None:
    cfg = parse_or_exit(PipelineConfig, argv, __spec__.name)
    with distributed(cfg.device) as ctx:
        on_gpu = ctx.device.type == "cuda"
        cfg.bf16 = on_gpu if cfg.bf16 is None else cfg.bf16
        cfg.channels_last = on_gpu if cfg.channels_last is None else cfg.channels_last
        torch.backends.cudnn.benchmark = on_gpu  # as chapter 3's in-process benchmark
        make, init = model_maker(cfg.model)
        stage, layers = build_stage(make, ctx.rank, ctx.world_size, ctx.device, (2, *SAMPLE),
                                    bf16=cfg.bf16, channels_last=cfg.channels_last, init=init)
        schedule = make_schedule(stage, cfg.schedule, cfg.micro_batches)
        torch.manual_seed(0)  # the same batch on every rank
        fmt = torch.channels_last if cfg.channels_last else torch.contiguous_format
        x = torch.randn(cfg.batch, *SAMPLE).to(ctx.device, memory_format=fmt)
        y = torch.randint(0, 10, (cfg.batch,)).to(ctx.device)
        train_step(schedule, stage, x, y)
        row = StageRow(ctx.world_size, cfg.model, cfg.batch, cfg.micro_batches, cfg.schedule,
                       "bf16" if cfg.bf16 else "fp32",
                       "channels_last" if cfg.channels_last else "contiguous", on_gpu,
                       params_per_rank(ctx, stage.submod))
        if cfg.check:
            row = dataclasses.replace(row, **grad_check(ctx, cfg, stage.submod, layers, x, y))
        if cfg.repeats:
            row.step_ms = benchmark(lambda: train_step(schedule, stage, x, y), warmup=2,
                                    repeats=cfg.repeats, device=ctx.device).median_ms
        if ctx.is_main:
            write_jsonl(cfg.out, [dataclasses.asdict(row)])


if __name__ == "__main__":
    main()
