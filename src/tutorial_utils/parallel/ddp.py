"""Data parallelism with one process per GPU: by hand, then with DistributedDataParallel.

Each process holds the whole model and trains on its own slice of the batch; after backward,
every gradient is averaged over the processes, so every replica takes the same step.

- :func:`all_reduce_gradients` is the naive version: one flat all-reduce after backward has
  finished. Correct, but the GPUs wait for the network while it runs.
- :class:`BucketedAllReduce` is what DDP does: gradients grouped into buckets in the order
  backward produces them (last layer first); a bucket is all-reduced as soon as its last
  gradient arrives, while backward goes on with earlier layers.
- :func:`ddp` wraps a model in ``DistributedDataParallel``, which does the same in C++ with
  more care (unused parameters, buffers, gradient accumulation with ``no_sync``). Use it.

What the all-reduce costs is chapter 3b's model, in :mod:`tutorial_utils.parallel.collectives`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .distributed import DistContext


def all_reduce_gradients(model: nn.Module, world_size: int) -> None:
    """Average ``.grad`` over all processes after ``loss.backward()``: one flat all-reduce."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)  # the sum over processes, in every process
    flat /= world_size
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


class BucketedAllReduce:
    """Average gradients during backward, a bucket at a time (DDP's overlap, by hand).

    ::

        sync = BucketedAllReduce(model, world_size)
        loss.backward()   # buckets leave as soon as they are full
        sync.wait()       # the last ones arrive; .grad now holds the averages
        optimizer.step()

    Every parameter must get a gradient in every step (DDP's ``find_unused_parameters``
    handles the others), and each is used once per step.
    """

    def __init__(self, model: nn.Module, world_size: int, bucket_mb: float = 25.0) -> None:
        self.world_size = world_size
        params = [p for p in model.parameters() if p.requires_grad]
        # Backward produces gradients roughly from the last layer to the first.
        self.buckets: list[list[nn.Parameter]] = [[]]
        size = 0
        for p in reversed(params):
            if size >= bucket_mb * 2**20:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += p.numel() * p.element_size()
        self._bucket_of = {p: i for i, b in enumerate(self.buckets) for p in b}
        self._ready = [0] * len(self.buckets)
        self._pending: list[tuple[dist.Work, torch.Tensor, list[nn.Parameter]]] = []
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    def _on_grad(self, p: nn.Parameter) -> None:
        i = self._bucket_of[p]
        self._ready[i] += 1
        if self._ready[i] == len(self.buckets[i]):  # the bucket is complete: send it now
            flat = torch.cat([q.grad.reshape(-1) for q in self.buckets[i]])
            work = dist.all_reduce(flat, async_op=True)
            self._pending.append((work, flat, self.buckets[i]))

    def wait(self) -> None:
        """Wait for every bucket's all-reduce and write the averages into ``.grad``."""
        if any(n != len(b) for n, b in zip(self._ready, self.buckets, strict=True)):
            raise RuntimeError("some parameters got no gradient in this step; "
                               "use DistributedDataParallel(find_unused_parameters=True)")
        for work, flat, params in self._pending:
            work.wait()
            flat /= self.world_size
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
                offset += p.numel()
        self._pending.clear()
        self._ready = [0] * len(self.buckets)

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()


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
    (CUDA graphs) the network stays one graph instead, its gradients all-reduced after
    backward: the all-reduces launched between the pieces cost more than the overlap saved
    on a step as short as WRN-28-10's. The setting is process-wide.
    """
    if mode == "none":
        return net
    if mode == "reduce-overhead" and ctx.is_distributed:
        torch._dynamo.config.optimize_ddp = False
    return torch.compile(net, mode=mode)
