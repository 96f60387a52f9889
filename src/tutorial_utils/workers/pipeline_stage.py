"""Run under torchrun: the production route to pipelining, one stage per process.

    torchrun --standalone --nproc_per_node=2 -m tutorial_utils.workers.pipeline_stage \\
        --model wrn-28-10 --batch 256 --micro-batches 8 --schedule 1f1b --out pipe.jsonl

Every process builds the same model, keeps its own consecutive slice of layers as a
``torch.distributed.pipelining.PipelineStage``, and a schedule (GPipe: all forwards, then all
backwards; 1F1B: alternate once the pipeline is full, which holds fewer activations) moves
micro-batches between processes. With ``--check`` each stage's gradients are compared with
those of the whole model trained in one process on the whole batch.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from ..models import wide_resnet
from ..parallel.distributed import distributed
from ..parallel.model_parallel import balanced_boundaries, forward_flops
from ..timing import benchmark
from .equivalence import small_net

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def build(name: str) -> nn.Sequential:
    """``cnn``: a small network without BatchNorm (exact checks); else a WRN name."""
    return small_net() if name == "cnn" else wide_resnet(name)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default="gpipe")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--check", action="store_true", help="compare with one process")
    parser.add_argument("--repeats", type=int, default=0, help="timed steps (0: none)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    with distributed(args.device) as ctx:
        torch.manual_seed(0)  # the same weights and batch on every rank
        full = build(args.model)
        x, y = torch.randn(args.batch, 3, 32, 32), torch.randint(0, 10, (args.batch,))
        costs = forward_flops(full, x[:2])  # stages of equal arithmetic
        starts = balanced_boundaries(full, ctx.world_size, costs)
        ends = [*starts[1:], len(full)]
        mine = list(range(starts[ctx.rank], ends[ctx.rank]))
        layers = list(copy.deepcopy(full))
        module = nn.Sequential(*(layers[i] for i in mine)).to(ctx.device)
        stage = PipelineStage(module, ctx.rank, ctx.world_size, ctx.device)
        schedule = SCHEDULES[args.schedule](stage, args.micro_batches, loss_fn=F.cross_entropy)
        first, last = ctx.rank == 0, ctx.rank == ctx.world_size - 1
        x, y = x.to(ctx.device), y.to(ctx.device)

        def step() -> None:
            module.zero_grad(set_to_none=True)
            if first:
                schedule.step(x)
            elif last:
                schedule.step(target=y, losses=[])
            else:
                schedule.step()

        step()
        record = {"world_size": ctx.world_size, "model": args.model, "batch": args.batch,
                  "micro_batches": args.micro_batches, "schedule": args.schedule}
        if args.check:
            reference = full.to(ctx.device)
            F.cross_entropy(reference(x), y).backward()
            ref_params = [p for i in mine for p in list(reference)[i].parameters()]
            diff = max((float((a.grad - b.grad).abs().max())
                        for a, b in zip(module.parameters(), ref_params, strict=True)), default=0.0)
            worst = torch.tensor([diff], device=ctx.device)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            record["max_grad_diff"] = worst.item()
        if args.repeats:
            record["step_ms"] = benchmark(step, warmup=2, repeats=args.repeats,
                                          device=ctx.device).median_ms
        if ctx.is_main:
            with open(args.out, "a") as f:
                f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
