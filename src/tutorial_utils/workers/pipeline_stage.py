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

import argparse
import functools
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..models import wide_resnet
from ..models.wrn import init_weights
from ..parallel.distributed import DistContext, distributed
from ..parallel.pipeline import (
    SCHEDULES,
    StageModule,
    build_stage,
    loss_fn,
    make_schedule,
    materialise,
    small_net,
    train_step,
)
from ..report import write_jsonl
from ..timing import benchmark

SAMPLE = (3, 32, 32)  # CIFAR-shaped images


def model_maker(name: str):
    """``cnn``: :func:`small_net` (no BatchNorm, exact checks); else a WRN name, with its init."""
    if name == "cnn":
        return small_net, None
    return functools.partial(wide_resnet, name), init_weights


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default="gpipe")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    on_gpus = argparse.BooleanOptionalAction
    parser.add_argument("--bf16", action=on_gpus, help="bf16 autocast (default: on GPUs)")
    parser.add_argument("--channels-last", action=on_gpus, help="(default: on GPUs)")
    parser.add_argument("--check", action="store_true", help="compare with one process")
    parser.add_argument("--repeats", type=int, default=0, help="timed steps (0: none)")
    parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args(argv)


def all_max(ctx: DistContext, *values: float) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def grad_check(ctx: DistContext, args, stage_module: nn.Module, layers: range,
               x: torch.Tensor, y: torch.Tensor) -> dict:
    """Largest gradient difference from the whole model, trained in this process on the whole
    batch with the pipeline's weights (built layer by layer as the stages were)."""
    make, init = model_maker(args.model)
    reference = StageModule(materialise(make, 0, None, ctx.device, init), args.bf16)
    if args.channels_last:
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
    args = parse(argv)
    with distributed(args.device) as ctx:
        on_gpu = ctx.device.type == "cuda"
        args.bf16 = on_gpu if args.bf16 is None else args.bf16
        args.channels_last = on_gpu if args.channels_last is None else args.channels_last
        torch.backends.cudnn.benchmark = on_gpu  # as chapter 3's in-process benchmark
        make, init = model_maker(args.model)
        stage, layers = build_stage(make, ctx.rank, ctx.world_size, ctx.device, (2, *SAMPLE),
                                    bf16=args.bf16, channels_last=args.channels_last, init=init)
        schedule = make_schedule(stage, args.schedule, args.micro_batches)
        torch.manual_seed(0)  # the same batch on every rank
        fmt = torch.channels_last if args.channels_last else torch.contiguous_format
        x = torch.randn(args.batch, *SAMPLE).to(ctx.device, memory_format=fmt)
        y = torch.randint(0, 10, (args.batch,)).to(ctx.device)
        train_step(schedule, stage, x, y)
        record = {"world_size": ctx.world_size, "model": args.model, "batch": args.batch,
                  "micro_batches": args.micro_batches, "schedule": args.schedule,
                  "precision": "bf16" if args.bf16 else "fp32",
                  "memory_format": "channels_last" if args.channels_last else "contiguous",
                  "cudnn_benchmark": on_gpu, "params_per_rank": params_per_rank(ctx, stage.submod)}
        if args.check:
            record.update(grad_check(ctx, args, stage.submod, layers, x, y))
        if args.repeats:
            record["step_ms"] = benchmark(lambda: train_step(schedule, stage, x, y), warmup=2,
                                          repeats=args.repeats, device=ctx.device).median_ms
        if ctx.is_main:
            write_jsonl(args.out, [record])


if __name__ == "__main__":
    main()
