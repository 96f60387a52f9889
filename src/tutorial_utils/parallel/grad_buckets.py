"""Data parallelism by hand, with DDP's overlap and fewer kernels: for a step recorded as a graph.

DDP all-reduces gradients in buckets while backward is still running, but on 2 H200s chapter
5b's profiler trace of a WRN-28-10 step recorded as one CUDA graph found costs that are not
communication: one copy kernel per gradient into its bucket and back, one kernel per gradient
to divide it by the number of processes, and a tail after backward. :class:`GradBuckets` does
the same job with fewer kernels:

- the gradients are grouped into buckets in the order backward produces them (last layer
  first); a hook on each parameter (``register_post_accumulate_grad_hook``) counts the ready
  ones;
- when a bucket is complete, one multi-tensor copy gathers its gradients into the bucket's
  flat buffer and one all-reduce averages it there (NCCL's ``AVG``: the division happens inside
  the collective), on NCCL's own stream, while backward goes on with earlier layers;
- the parameters' ``.grad`` become views of the averaged buffers: nothing is copied back;
- :meth:`GradBuckets.wait` makes the current stream wait for the all-reduces; then the
  optimizer runs as usual.

On 2 H200s it removed the scaling kernels, more than half of the copying and most of the
tail, and the step was no shorter: the convolutions running beside NCCL's kernels slowed by
about as much (chapter 5b, with the traces in ``book/logs/``). It is here to show the
mechanism and to test that account.

With ``wire_dtype=torch.bfloat16`` the buckets travel in bfloat16, half the bytes: the gather
rounds each gradient on the way in, and :meth:`~GradBuckets.wait` widens every averaged bucket
back into float32 gradients with one copy per bucket.

What it leaves out, and DDP does not: parameters that get no gradient in a step (DDP's
``find_unused_parameters``; here :meth:`~GradBuckets.wait` raises), parameters used twice in
one step, gradient accumulation, and broadcasting BatchNorm statistics every step (call
:meth:`~GradBuckets.average_buffers` before evaluating instead). In practice use DDP.

Backward must hand out the gradients progressively for the all-reduces to overlap it: an eager
network does; one compiled whole returns every gradient at the end of one backward graph (DDP
gets around that by splitting the compiled graph at its bucket boundaries). Compile such a
network piece by piece with :func:`compile_children`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from .data_parallel import broadcast_parameters
from .distributed import DistContext


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    flat: torch.Tensor  # the bucket's gradients, one after the other
    views: list[torch.Tensor]  # each parameter's slice of ``flat``, shaped and strided like it
    wire: torch.Tensor  # what is all-reduced: ``flat`` itself, or a narrower copy of it
    wire_views: list[torch.Tensor]
    ready: set[int] = field(default_factory=set)  # ids of the parameters whose gradient is in
    work: dist.Work | None = None


class GradBuckets:
    """Average the gradients of ``module`` over all processes, bucket by bucket, during backward.

    ::

        sync = GradBuckets(net, ctx)  # broadcasts rank 0's weights and buffers
        loss.backward()               # all-reduces start as buckets fill
        sync.wait()                   # .grad holds the average over all processes
        optimizer.step()

    With one process it does nothing. Use it as a context manager to remove its hooks.
    """

    def __init__(self, module: nn.Module, ctx: DistContext, bucket_mb: float = 25.0,
                 wire_dtype: torch.dtype | None = None) -> None:
        if bucket_mb <= 0:
            raise ValueError(f"the bucket size must be > 0 MB, got {bucket_mb}")
        self.ctx = ctx
        self.module = module
        self.enabled = True
        self.buckets: list[_Bucket] = []
        self._bucket_of: dict[int, _Bucket] = {}
        self._hooks = []
        params = [p for p in module.parameters() if p.requires_grad]
        kinds = {(p.dtype, p.device) for p in params}
        if len(kinds) > 1:
            raise ValueError(f"GradBuckets needs every trained parameter in one dtype on one "
                             f"device, got {sorted(map(str, kinds))}; use DDP")
        if not ctx.is_distributed:
            return
        broadcast_parameters(module)  # every process starts from rank 0's weights
        # Backward reaches the last layers first: fill buckets from the end.
        for group in _groups(list(reversed(params)), int(bucket_mb * 2**20)):
            bucket = _make_bucket(group, wire_dtype)
            self.buckets.append(bucket)
            for p in group:
                self._bucket_of[id(p)] = bucket
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
        # NCCL divides inside the all-reduce; Gloo has no AVG: divide first, then sum.
        self._avg = dist.get_backend() == dist.Backend.NCCL

    def _on_grad(self, p: nn.Parameter) -> None:
        if not self.enabled:
            return
        bucket = self._bucket_of[id(p)]
        if id(p) in bucket.ready:
            raise RuntimeError("a parameter received two gradients in one backward: "
                               "GradBuckets needs every parameter used once per step; use DDP")
        bucket.ready.add(id(p))
        if len(bucket.ready) == len(bucket.params):
            self._all_reduce(bucket)

    @torch.no_grad()
    def _all_reduce(self, bucket: _Bucket) -> None:
        # One multi-tensor copy kernel (a few for many tensors), not one per gradient.
        torch._foreach_copy_(bucket.wire_views, [p.grad for p in bucket.params])
        bucket.work = self._average(bucket.wire, async_op=True)
        for p, view in zip(bucket.params, bucket.views, strict=True):
            p.grad = view  # filled with the average once the all-reduce is done

    def wait(self) -> None:
        """Order the current stream after every bucket's all-reduce (call after backward)."""
        if not self.enabled:
            return
        missing = sum(len(b.params) - len(b.ready) for b in self.buckets if b.work is None)
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()  # on a GPU: a stream dependency, the host does not block
                if bucket.wire is not bucket.flat:
                    with torch.no_grad():
                        bucket.flat.copy_(bucket.wire)  # widened, in the same layout
            bucket.work = None
            bucket.ready.clear()
        if missing:
            raise RuntimeError(
                f"{missing} parameter(s) got no gradient in this backward: GradBuckets needs "
                "every parameter to take part in every step; use DDP with "
                "find_unused_parameters=True")

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """``with sync.pause():`` backward without any communication (compute alone)."""
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = True

    @torch.no_grad()
    def average_buffers(self) -> None:
        """Average floating-point buffers (BatchNorm statistics) over the processes."""
        if not self.ctx.is_distributed:
            return
        for t in self.module.buffers():
            if t.is_floating_point():
                self._average(t)

    def _average(self, t: torch.Tensor, async_op: bool = False) -> dist.Work | None:
        """All-reduce ``t`` in place into the mean over the processes."""
        if self._avg:
            return dist.all_reduce(t, op=dist.ReduceOp.AVG, async_op=async_op)
        t.div_(self.ctx.world_size)
        return dist.all_reduce(t, async_op=async_op)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def __enter__(self) -> GradBuckets:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _groups(params: list[nn.Parameter], cap_bytes: int) -> list[list[nn.Parameter]]:
    """Consecutive parameters in groups of at most ``cap_bytes`` (a larger tensor: alone)."""
    groups: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if not groups or size + nbytes > cap_bytes:
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += nbytes
    return groups


def _make_bucket(params: list[nn.Parameter], wire_dtype: torch.dtype | None) -> _Bucket:
    flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype,
                       device=params[0].device)
    wire = flat if wire_dtype in (None, flat.dtype) else flat.to(wire_dtype)
    return _Bucket(params, flat, _views(flat, params), wire, _views(wire, params))


def _views(flat: torch.Tensor, params: list[nn.Parameter]) -> list[torch.Tensor]:
    # Same strides as each parameter (channels_last kernels too), so a gradient copies in as
    # one block and the optimizer reads it in the parameter's own layout.
    views, offset = [], 0
    for p in params:
        views.append(flat.as_strided(p.shape, p.stride(), offset))
        offset += p.numel()
    return views


def compile_children(net: nn.Module, mode: str = "default") -> nn.Module:
    """``torch.compile`` each child of ``net`` that has parameters, in place; returns ``net``.

    Each piece gets its own backward graph, so gradients come out piece by piece during
    backward and :class:`GradBuckets` can all-reduce the first buckets while the rest runs.
    Children of the same shapes share one compilation; ``dynamic=False`` keeps the others from
    turning the shared code into one with symbolic sizes.
    """
    if mode == "none":
        return net
    for child in net.children():
        if any(True for _ in child.parameters()):
            child.compile(mode=mode, dynamic=False)
    return net
