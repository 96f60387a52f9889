"""Run under torchrun: causal attention on a long sequence, forward and backward, timed.

    torchrun --standalone --nproc_per_node=2 -m tutorial_utils.bench.workers.cp_step \\
        --seqs 8192 16384 --out cp.jsonl

One row per (mode, sequence length). ``one-process``: each rank computes the whole sequence on
its own, what a single GPU must hold. ``ring``: the hand-written ring attention with zig-zag
(:mod:`tutorial_utils.parallel.context`); it computes each block's scores as a whole matrix,
so it runs out of memory long before a fused kernel does. ``context_parallel``: PyTorch's
ring, on GPUs only. bf16 on GPUs, fp32 on the CPU. Each row holds the median time of forward
and backward, the allocator's peak during the step above what was allocated before it (GPUs
only), and the bytes the attention kept for backward, each the busiest rank's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...config import Config, check, opt, parse_or_exit
from ...jsonl import write_jsonl
from ...memory import saved_tensors
from ...parallel.context import (
    attention_bytes_per_rank,
    check_split,
    pytorch_ring,
    ring_attention,
    shard,
)
from ...parallel.distributed import DistContext, distributed
from ...timing import benchmark, synchronize

Mode = Literal["one-process", "ring", "context_parallel"]


@dataclass
class CPStepConfig(Config):
    """Run under torchrun: causal attention's step against sequence length, one row a mode."""

    out: Path = opt(Path("runs/cp_step.jsonl"), "rank 0 writes one JSON line per row here")
    modes: tuple[Mode, ...] = opt(("one-process", "ring", "context_parallel"),
                                  "context_parallel runs on GPUs only")
    seqs: tuple[int, ...] = opt((4096, 8192, 16384, 32768), "sequence lengths (multiples of 2N)")
    batch: int = opt(1, "sequences")
    heads: int = opt(16, "attention heads")
    head_dim: int = opt(128, "values per head")
    repeats: int = opt(5, "timed steps per row")
    device: Literal["auto", "cpu", "cuda"] = opt("auto", "cuda needs one GPU per process")

    def __post_init__(self) -> None:
        check((bool(self.seqs) and bool(self.modes), "--seqs and --modes need values"),
              (min(self.batch, self.heads, self.head_dim, self.repeats, *self.seqs) >= 1,
               "--batch, --heads, --head-dim, --repeats and --seqs must be >= 1"))


@dataclass
class CPStepRow:
    """One mode at one sequence length, on the busiest rank."""

    mode: str
    world: int
    seq: int
    step_ms: float | None = None  # forward + backward, median
    peak_mib: float | None = None  # GPUs: the step's peak above what was allocated before
    saved_mib: float | None = None  # kept for backward by the attention (not context_parallel)
    predicted_mib: float | None = None  # attention_bytes_per_rank (N = 1 for one-process)
    oom: bool = False  # out of memory, or (the ring by hand) predicted to be and not run


def _enough(cfg: CPStepConfig) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    check((world >= 2, "run it under torchrun with 2 or more processes"))
    for seq in cfg.seqs:
        check_split(seq, world, zigzag=True)


def _attention(mode: Mode, seq: int, ctx: DistContext):
    """The attention function of ``mode``, and the context forward and backward run in."""
    if mode == "ring":
        return functools.partial(ring_attention, zigzag=True), contextlib.nullcontext
    sdpa = functools.partial(F.scaled_dot_product_attention, is_causal=True)
    if mode == "one-process":
        return sdpa, contextlib.nullcontext
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cuda", (ctx.world_size,))
    return sdpa, functools.partial(pytorch_ring, mesh, seq, ctx.device)


def _measure(mode: Mode, seq: int, cfg: CPStepConfig, ctx: DistContext) -> list[float]:
    """[step ms, peak MiB, saved MiB] on this rank (-1 where not measured)."""
    cuda = ctx.device.type == "cuda"
    torch.manual_seed(0)
    whole = torch.randn(4, cfg.batch, cfg.heads, seq, cfg.head_dim, device=ctx.device,
                        dtype=torch.bfloat16 if cuda else torch.float32)
    if mode != "one-process":
        whole = shard(whole, ctx.rank, ctx.world_size, zigzag=True, dim=3)
    q, k, v = (t.clone().requires_grad_() for t in whole[:3])
    attend, around = _attention(mode, seq, ctx)

    def step() -> None:
        with around():
            attend(q, k, v).backward(whole[3])
        q.grad = k.grad = v.grad = None

    saved = -1.0
    if mode != "context_parallel":
        with saved_tensors() as kept:
            attend(q, k, v)
        saved = sum(kept["activations"].values()) / 2**20
    if cuda:
        synchronize(ctx.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(ctx.device)
    before = torch.cuda.memory_allocated(ctx.device) if cuda else 0
    t = benchmark(step, warmup=2, repeats=cfg.repeats, device=ctx.device)
    peak = (torch.cuda.max_memory_allocated(ctx.device) - before) / 2**20 if cuda else -1.0
    return [t.median_ms, peak, saved]


def _ring_fits(cfg: CPStepConfig, seq: int, ctx: DistContext) -> bool:
    """Whether the hand-written ring's score blocks fit in half the GPU: about four fp32
    matrices of (S / 2N)^2 per head live at once in backward. A rank that ran out of memory in
    the middle of the ring would leave the others waiting for its blocks."""
    if ctx.device.type != "cuda":
        return True
    chunk = seq // (2 * ctx.world_size)
    need = 4 * cfg.batch * cfg.heads * chunk**2 * 4
    return need < 0.5 * torch.cuda.get_device_properties(ctx.device).total_memory


def measure(mode: Mode, seq: int, cfg: CPStepConfig, ctx: DistContext) -> CPStepRow:
    try:
        if mode == "ring" and not _ring_fits(cfg, seq, ctx):
            raise torch.OutOfMemoryError("the score blocks would not fit: not run")
        values = _measure(mode, seq, cfg, ctx) + [0.0]
    except torch.OutOfMemoryError:  # every rank holds as much: they run out together
        values = [-1.0] * 3 + [1.0]
    busiest = torch.tensor(values, device=ctx.device, dtype=torch.float64)
    dist.all_reduce(busiest, op=dist.ReduceOp.MAX)
    step_ms, peak, saved, oom = (None if x < 0 else x for x in busiest.tolist())
    size = 2 if ctx.device.type == "cuda" else 4
    world = 1 if mode == "one-process" else ctx.world_size
    return CPStepRow(mode, ctx.world_size, seq, step_ms, peak, saved, attention_bytes_per_rank(
        cfg.batch, cfg.heads, seq, cfg.head_dim, world, value_bytes=size) / 2**20, bool(oom))


def main(argv: list[str] | None = None) -> None:
    cfg = parse_or_exit(CPStepConfig, argv, __spec__.name, machine=_enough)
    with distributed(cfg.device) as ctx:
        modes = [m for m in cfg.modes if m != "context_parallel" or ctx.device.type == "cuda"]
        rows = [measure(m, seq, cfg, ctx) for seq in cfg.seqs for m in modes]
        if ctx.is_main:
            write_jsonl(cfg.out, [dataclasses.asdict(r) for r in rows])


if __name__ == "__main__":
    main()
