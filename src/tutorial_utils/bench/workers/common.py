"""What the measuring workers share: a group of one, fresh batches, one way to time a step.

A worker that compares several ways of running the same step (FSDP's modes, DDP's knobs) runs
them one after another in the same processes, each from the same weights on the same batches,
so that every difference in the table comes from the way, not from the data or the machine.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable

import torch
import torch.distributed as dist

from ...parallel.distributed import DistContext
from ...timing import benchmark, host_clock_without_sync, synchronize


@contextlib.contextmanager
def group_of_one(ctx: DistContext):
    """A process group for a single process, so that DDP and FSDP2 wrap the model there too:
    what they then cost is their host work and copies, with nothing to communicate."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("nccl" if ctx.device.type == "cuda" else "gloo",
                            store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def fresh_batches(ctx: DistContext, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Forget the previous way, then two random batches: each rank its own, the same per way."""
    dev = ctx.device
    gc.collect()  # the previous way's model may sit in a reference cycle
    torch.compiler.reset()  # else each way adds variants until the cache limit is hit
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    g = torch.Generator().manual_seed(1 + ctx.rank)
    return [(torch.randn(batch, 3, 32, 32, generator=g).to(dev)
             .to(memory_format=torch.channels_last),
             torch.randint(0, 10, (batch,), generator=g).to(dev)) for _ in range(2)]


def time_steps(step: Callable[[], object], ctx: DistContext, batch: int, repeats: int) -> dict:
    """The step's median time and spread, then the host's time to queue one step alone."""
    dev = ctx.device
    t = benchmark(step, warmup=5, repeats=repeats, device=dev)
    synchronize(dev)  # the host clock below times the queueing of one step alone
    host = host_clock_without_sync(step, repeats=5).median_ms
    synchronize(dev)
    return {"step_ms": t.median_ms, "step_spread": t.spread, "host_ms": host,
            "images_per_s": batch * ctx.world_size / t.median_ms * 1e3}
