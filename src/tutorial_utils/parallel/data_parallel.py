"""Data parallelism: one process driving several GPUs, and one process per GPU.

In practice use :class:`~torch.nn.parallel.DistributedDataParallel` (:func:`ddp`): one process
per GPU, gradients all-reduced in buckets while backward is still running. The other functions
here exist to show the mechanisms:

- :func:`data_parallel_forward` is what ``nn.DataParallel`` does on every call (replicate,
  scatter, parallel_apply on one thread per GPU, gather on the first GPU);
- :func:`make_data_parallel` is the heir of the Torch7 post's ``makeDataParallelTable``;
- :func:`all_reduce_gradients` is data parallelism written by hand: after backward, average
  the gradients of all processes in one flat all-reduce.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import (
    DistributedDataParallel,
    gather,
    parallel_apply,
    replicate,
    scatter,
)

from ..devices import default_device, require_gpus
from .distributed import DistContext


def data_parallel_forward(
    module: nn.Module, x: torch.Tensor, devices: list[torch.device]
) -> torch.Tensor:
    """One ``nn.DataParallel`` forward, step by step (``module`` lives on ``devices[0]``).

    Every call copies the parameters to every GPU again and starts one Python thread per GPU;
    the outputs (and later the loss) come together on GPU 0, which therefore does more work
    and holds more memory than the others.
    """
    replicas = replicate(module, devices)  # parameters broadcast from devices[0], every step
    chunks = scatter(x, devices)  # split along dim 0, one chunk per GPU
    outputs = parallel_apply(replicas[: len(chunks)], [(c,) for c in chunks], devices=devices)
    return gather(outputs, devices[0])  # concatenated on the first GPU


def make_data_parallel(model: nn.Module, n_gpus: int) -> nn.Module:
    """``nn.DataParallel`` over GPUs 0..n-1 (the model alone on one device when n <= 1).

    The Torch7 helper also re-applied ``cudnn.benchmark`` in every worker thread, because
    those settings were per thread. PyTorch's flag is global, but cuDNN's autotuning cache is
    still per thread, and DataParallel starts fresh threads on every call, so with
    ``torch.backends.cudnn.benchmark = True`` every step can pay for autotuning again.
    """
    if n_gpus <= 1:
        return model.to(default_device())
    devices = require_gpus(n_gpus)
    return nn.DataParallel(model.to(devices[0]), device_ids=[d.index for d in devices])


def broadcast_parameters(model: nn.Module, src: int = 0) -> None:
    """Make every process start from rank ``src``'s weights (DDP does this in its constructor)."""
    for t in list(model.parameters()) + list(model.buffers()):
        dist.broadcast(t.data, src)


def all_reduce_gradients(model: nn.Module, world_size: int) -> None:
    """Average ``.grad`` over all processes after ``loss.backward()``: one flat all-reduce.

    Equivalent to DDP's result, but it starts only after backward has finished, so none of
    the communication overlaps with computation.
    """
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= world_size
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def ddp(model: nn.Module, ctx: DistContext, **kwargs) -> nn.Module:
    """Wrap ``model`` (already on ``ctx.device``) in DDP; a no-op for a single process."""
    if not ctx.is_distributed:
        return model
    ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids, **kwargs)


def compile_for_ddp(net: nn.Module, mode: str, ctx: DistContext) -> nn.Module:
    """``torch.compile`` a network that :func:`ddp` will wrap; mode "none" leaves it eager.

    By default ``torch.compile`` cuts a network under DDP into one graph per gradient bucket,
    so that each bucket's all-reduce overlaps the rest of backward. With "reduce-overhead"
    (CUDA graphs) the network stays one graph instead: the all-reduces launched between the
    pieces made a 64-image WRN-28-10 step on 2 H200s 1.6x slower than one graph whose
    gradients are all-reduced after backward (chapter 5b). The setting is process-wide.
    """
    if mode == "none":
        return net
    if mode == "reduce-overhead" and ctx.is_distributed:
        torch._dynamo.config.optimize_ddp = False
    return torch.compile(net, mode=mode)


def ring_all_reduce_seconds(nbytes: float, world_size: int, bus_gbps: float) -> float:
    """Time of a ring all-reduce of ``nbytes``: each GPU sends and receives 2(N-1)/N of it.

    ``bus_gbps`` is the bus bandwidth (GB/s) as NCCL's tests report it, i.e. already
    normalised by that 2(N-1)/N factor: measure it with :func:`measure_bus_bandwidth`.
    """
    if world_size < 2:
        return 0.0
    return 2 * (world_size - 1) / world_size * nbytes / (bus_gbps * 1e9)


def measure_bus_bandwidth(ctx: DistContext, nbytes: int, repeats: int = 10) -> float:
    """All-reduce bus bandwidth in GB/s for a float32 buffer of ``nbytes``, median of repeats."""
    from ..timing import benchmark

    buf = torch.ones(nbytes // 4, device=ctx.device)
    t = benchmark(lambda: dist.all_reduce(buf), warmup=3, repeats=repeats, device=ctx.device)
    n = ctx.world_size
    return 2 * (n - 1) / n * nbytes / (t.median_ms * 1e-3) / 1e9
