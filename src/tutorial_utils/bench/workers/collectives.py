"""Run under torchrun: time each collective over message sizes; rank 0 writes JSON lines.

    torchrun --standalone --nproc_per_node=2 -m tutorial_utils.bench.workers.collectives \\
        --sizes 4096 1048576 268435456 --ring-sizes 1048576 --check-bytes 145916776 --out c.jsonl

One line per (collective, size), with the median time over the repeats, its quartiles, and the
algorithm and bus bandwidth. A size is NCCL's: the whole buffer of an all-reduce or broadcast,
the input of a reduce-scatter, the output of an all-gather (float32, so a multiple of 4N bytes).
Before timing, the hand-written ring all-reduce is checked against ``dist.all_reduce`` (one line
with role "equal"); with ``--check-bytes`` chapter 4's all-reduce of that many bytes is timed
too (role "check"), to test the alpha-beta model's prediction for exactly that size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist

from ...config import Config, check, opt, parse_or_exit
from ...jsonl import write_jsonl
from ...parallel.collectives import (
    algbw_gbps,
    bus_factor,
    busbw_gbps,
    measure_bus_bandwidth,
    ring_all_reduce,
)
from ...parallel.distributed import DistContext, distributed
from ...timing import benchmark

COLLECTIVES = ("broadcast", "all_reduce", "reduce_scatter", "all_gather")
# Newer PyTorch renames these two (the old names then warn); older releases have only the old.
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class CollectivesWorkerConfig(Config):
    """Run under torchrun: time each collective over message sizes; rank 0 writes JSON lines."""

    sizes: tuple[int, ...] = opt((), "message sizes in bytes")
    ring_sizes: tuple[int, ...] = opt((), "sizes at which to time the hand-written ring too")
    check_bytes: int | None = opt(None, "time chapter 4's all-reduce of this many bytes")
    warmup: int = opt(5, "untimed calls first")
    repeats: int = opt(20, "timed calls; the median is reported")
    device: Literal["auto", "cpu", "cuda"] = opt("auto", "cuda needs one GPU per process")
    out: Path = opt(Path("runs/collectives.jsonl"), "rank 0 appends its JSON lines here")

    def __post_init__(self) -> None:
        check((bool(self.sizes), "--sizes needs at least one size"),
              (min(self.sizes + self.ring_sizes, default=1) >= 1, "every size must be >= 1"),
              (self.warmup >= 0 and self.repeats >= 1, "need --warmup >= 0 and --repeats >= 1"))


def operation(name: str, nbytes: int, ctx: DistContext) -> Callable[[], object]:
    """One call of collective ``name`` on float32 buffers allocated once, outside the timing."""
    n = ctx.world_size
    if nbytes % (4 * n):
        raise ValueError(f"{nbytes} bytes is not a multiple of 4 x {n} ranks")
    # Zeros: sums of zeros never overflow or turn denormal, which could slow the CPU's adds.
    whole = torch.zeros(nbytes // 4, device=ctx.device)
    part = torch.zeros(nbytes // 4 // n, device=ctx.device)
    ops = {
        "broadcast": lambda: dist.broadcast(whole, src=0),
        "all_reduce": lambda: dist.all_reduce(whole),
        "reduce_scatter": lambda: reduce_scatter(part, whole),
        "all_gather": lambda: all_gather(whole, part),
        "ring_all_reduce": lambda: ring_all_reduce(whole),
    }
    return ops[name]


@dataclass
class CollectiveRow:
    """Rank 0's row: a collective timed at one size (``sweep``), the hand-written ring against
    ``dist.all_reduce`` (``equal``), or chapter 4's all-reduce of a network's gradients
    (``check``)."""

    collective: str
    role: str  # "sweep", "equal" or "check"
    world_size: int = 0
    backend: str = ""
    device: str = ""
    nbytes: int | None = None
    time_s: float | None = None  # median
    q25_s: float | None = None
    q75_s: float | None = None
    repeats: int | None = None
    algbw_gbps: float | None = None
    busbw_gbps: float | None = None
    numel: int | None = None  # role "equal": the numbers compared
    max_diff: float | None = None


def measure(name: str, nbytes: int, ctx: DistContext, args: CollectivesWorkerConfig) -> dict:
    fn = operation(name, nbytes, ctx)
    ctx.barrier()  # start together: a late rank's delay would land in the first calls
    t = benchmark(fn, warmup=args.warmup, repeats=args.repeats, device=ctx.device)
    seconds = t.median_ms / 1e3
    # Every rank times the same calls; a collective ends together on all ranks, within the
    # time its last message takes, so rank 0's time (the one written) stands for all.
    return {"collective": name, "role": "sweep", "nbytes": nbytes, "time_s": seconds,
            "q25_s": t.q25_ms / 1e3, "q75_s": t.q75_ms / 1e3, "repeats": len(t),
            "algbw_gbps": algbw_gbps(nbytes, seconds),
            "busbw_gbps": busbw_gbps(name, nbytes, seconds, ctx.world_size)}


def ring_equals_all_reduce(ctx: DistContext, numel: int = 1001) -> dict:
    """Largest difference between the hand-written ring and ``dist.all_reduce`` on random data
    whose length N need not divide (1001 elements by default)."""
    gen = torch.Generator().manual_seed(ctx.rank)  # different data on every rank
    x = torch.randn(numel, generator=gen).to(ctx.device)
    expected = x.clone()
    dist.all_reduce(expected)
    diff = (ring_all_reduce(x) - expected).abs().max().item()
    return {"collective": "ring_all_reduce", "role": "equal", "numel": numel, "max_diff": diff}


def gradient_check(nbytes: int, ctx: DistContext, repeats: int) -> dict:
    """Chapter 4's measurement (one flat float32 all-reduce), as a time."""
    bus = measure_bus_bandwidth(nbytes, ctx.device, repeats=repeats)
    seconds = nbytes * bus_factor("all_reduce", ctx.world_size) / (bus * 1e9)
    return {"collective": "all_reduce", "role": "check", "nbytes": nbytes, "time_s": seconds,
            "algbw_gbps": algbw_gbps(nbytes, seconds), "busbw_gbps": bus}


def run(args: CollectivesWorkerConfig, ctx: DistContext) -> list[dict]:
    records = [ring_equals_all_reduce(ctx)]
    for name in COLLECTIVES:
        records += [measure(name, nbytes, ctx, args) for nbytes in args.sizes]
    records += [measure("ring_all_reduce", nbytes, ctx, args) for nbytes in args.ring_sizes]
    if args.check_bytes:
        records.append(gradient_check(args.check_bytes, ctx, args.repeats))
    common = {"world_size": ctx.world_size, "backend": dist.get_backend(),
              "device": ctx.device.type}
    return [common | r for r in records]


def main(argv: list[str] | None = None) -> None:
    args = parse_or_exit(CollectivesWorkerConfig, argv, __spec__.name)
    with distributed(args.device) as ctx:
        if not ctx.is_distributed:
            raise SystemExit("run under torchrun with --nproc_per_node >= 2: collectives "
                             "need several processes")
        records = run(args, ctx)
        if ctx.is_main:
            write_jsonl(args.out, [dataclasses.asdict(CollectiveRow(**r)) for r in records])


if __name__ == "__main__":
    main()
