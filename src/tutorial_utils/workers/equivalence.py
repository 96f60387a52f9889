"""Run under torchrun: do DDP, the hand-written all-reduces and ``no_sync`` accumulation give
the gradients of one process on the whole batch?

    torchrun --standalone --nproc_per_node=2 -m tutorial_utils.workers.equivalence --out r.jsonl

Every rank builds the same model and the same global batch; rank r trains on the r-th slice.
Rank 0 writes one JSON line with the largest gradient difference of each method.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from ..config import Config, check, opt, parse_or_exit
from ..jsonl import write_jsonl
from ..parallel.ddp import BucketedAllReduce, all_reduce_gradients, ddp
from ..parallel.distributed import DistContext, distributed


@dataclass
class EquivalenceConfig(Config):
    """Run under torchrun: do DDP and the all-reduces by hand give one process's gradients?"""

    out: Path = opt(Path("runs/equivalence.jsonl"), "rank 0 appends its JSON line here")
    batch: int = opt(32, "the global batch, split evenly over the processes")
    device: Literal["auto", "cpu", "cuda"] = opt("auto", "cuda needs one GPU per process")
    batchnorm: bool = opt(False, "add a BatchNorm layer")
    sync_bn: bool = opt(False, "...as SyncBatchNorm")

    def __post_init__(self) -> None:
        check((self.batch >= 2 and self.batch % 2 == 0,
               f"--batch must be even and >= 2 (two micro-batches per rank), got {self.batch}"))


def small_net(batchnorm: bool = False) -> nn.Sequential:
    norm = nn.BatchNorm2d(16) if batchnorm else nn.Identity()
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), norm, nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1),
        nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
    )


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def compare(ctx: DistContext, batch: int, batchnorm: bool, sync_bn: bool) -> dict:
    torch.manual_seed(0)  # the same model and global batch on every rank
    base = small_net(batchnorm).to(ctx.device)
    x = torch.randn(batch, 3, 16, 16, device=ctx.device)
    y = torch.randint(0, 10, (batch,), device=ctx.device)
    mine = slice(ctx.rank * batch // ctx.world_size, (ctx.rank + 1) * batch // ctx.world_size)

    reference = copy.deepcopy(base)
    F.cross_entropy(reference(x), y).backward()  # one process, whole batch

    replica = copy.deepcopy(base)
    if sync_bn:
        replica = nn.SyncBatchNorm.convert_sync_batchnorm(replica)
    wrapped = ddp(replica, ctx)
    F.cross_entropy(wrapped(x[mine]), y[mine]).backward()  # DDP averages over ranks

    manual = copy.deepcopy(base)
    F.cross_entropy(manual(x[mine]), y[mine]).backward()
    all_reduce_gradients(manual, ctx.world_size)

    bucketed = copy.deepcopy(base)
    sync = BucketedAllReduce(bucketed, ctx.world_size, bucket_mb=0.001)  # many buckets
    F.cross_entropy(bucketed(x[mine]), y[mine]).backward()
    sync.wait()
    sync.remove()

    accumulated = ddp(copy.deepcopy(base), ctx)  # two micro-batches, one all-reduce
    half = x[mine].shape[0] // 2
    with accumulated.no_sync():
        (F.cross_entropy(accumulated(x[mine][:half]), y[mine][:half]) / 2).backward()
    (F.cross_entropy(accumulated(x[mine][half:]), y[mine][half:]) / 2).backward()

    ref = _grads(reference)
    return {
        "world_size": ctx.world_size, "batchnorm": batchnorm, "sync_bn": sync_bn,
        "ddp_vs_reference": _max_diff(_grads(wrapped), ref),
        "manual_vs_ddp": _max_diff(_grads(manual), _grads(wrapped)),
        "no_sync_vs_reference": _max_diff(_grads(accumulated), ref),
        "bucketed_vs_ddp": _max_diff(_grads(bucketed), _grads(wrapped)),
    }


def main(argv: list[str] | None = None) -> None:
    cfg = parse_or_exit(EquivalenceConfig, argv, __spec__.name)
    with distributed(cfg.device) as ctx:
        result = compare(ctx, cfg.batch, cfg.batchnorm or cfg.sync_bn, cfg.sync_bn)
        if ctx.is_main:
            write_jsonl(cfg.out, [result])


if __name__ == "__main__":
    main()
