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
about as much (chapter 5b, with the traces in ``book/logs/``). With the copy-engine transport
below, the convolutions ran as fast as on one GPU and the step was shorter than DDP's at 64 and
at 128 images per GPU; what it still added was the copying into the shared buffer and the
averaging kernels beside backward. :class:`AveragingSGD` takes the averaging out of backward:
it reads the rows in the pass that updates the weights, and shortened the step again; the copy
into the shared buffer, moved from the compute stream to the transport's own, shortened it a
little more. It is all here to show the mechanism and to test that account.

With ``wire_dtype=torch.bfloat16`` the buckets travel in bfloat16, half the bytes: the gather
rounds each gradient on the way in, and the average is widened back into float32 gradients.

``transport="copy-engine"`` (GPUs that can map each other's memory: NVLink or PCIe peer
access) averages without NCCL's kernels, which hold multiprocessors that backward wants. All
buckets live in one buffer of PyTorch's symmetric memory, one row per process, mapped into
every process. Each process copies a finished bucket into its own row on a stream of its
own, beside the rest of backward; when a bucket is written everywhere (a barrier), each one
pulls the other rows' slices with ``cudaMemcpyAsync``, which the GPU's copy engines (DMA)
carry out, and adds the rows (each divided by the number of processes on its way in) into the
gradients. Every process adds the same rows in the same order, so they all get the same bits.

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
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from tutorial_utils.parallel.ddp import broadcast_parameters
from tutorial_utils.parallel.distributed import DistContext


@dataclass
class _Bucket:
    index: int  # in the order backward fills them
    params: list[nn.Parameter]
    flat: torch.Tensor  # the bucket's gradients, one after the other
    views: list[torch.Tensor]  # each parameter's slice of ``flat``, shaped and strided like it
    wire_views: list[torch.Tensor]  # the same slices of what travels (the transport's wire)
    ready: set[int] = field(default_factory=set)  # ids of the parameters whose gradient is in
    started: bool = False  # its average is under way


class GradBuckets:
    """Average the gradients of ``module`` over all processes, bucket by bucket, during backward.

    ::

        sync = GradBuckets(net, ctx)  # broadcasts rank 0's weights and buffers
        loss.backward()               # averages start as buckets fill
        sync.wait()                   # .grad holds the average over all processes
        optimizer.step()

    ``transport`` is ``"all-reduce"`` (the process group's collective: NCCL, or Gloo on CPUs)
    or ``"copy-engine"`` (GPUs only; see the module's notes). With one process it does
    nothing. Use it as a context manager to remove its hooks.
    """

    def __init__(self, module: nn.Module, ctx: DistContext, bucket_mb: float = 25.0,
                 wire_dtype: torch.dtype | None = None,
                 transport: Literal["all-reduce", "copy-engine"] = "all-reduce") -> None:
        if bucket_mb <= 0:
            raise ValueError(f"the bucket size must be > 0 MB, got {bucket_mb}")
        if transport not in ("all-reduce", "copy-engine"):
            raise ValueError(f"transport must be 'all-reduce' or 'copy-engine', got {transport!r}")
        if transport == "copy-engine" and ctx.device.type != "cuda":
            raise ValueError(f"the copy-engine transport copies between GPUs; on "
                             f"{ctx.device.type} use transport='all-reduce'")
        self.ctx = ctx
        self.module = module
        self.enabled = True
        self._rows_to_optimizer = False  # AveragingSGD averages the rows in its update
        self._transport: _AllReduce | _PeerCopies | None = None  # none for one process
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
        local = int(os.environ.get("LOCAL_WORLD_SIZE", ctx.world_size))
        if transport == "copy-engine" and local != ctx.world_size:
            raise ValueError(f"the copy-engine transport maps the other GPUs' memory, so all "
                             f"{ctx.world_size} processes must run on one machine (found "
                             f"{local} here); use transport='all-reduce'")
        broadcast_parameters(module)  # every process starts from rank 0's weights
        # Backward reaches the last layers first: fill buckets from the end.
        groups = _groups(list(reversed(params)), int(bucket_mb * 2**20))
        flats = [torch.zeros(sum(map(_span, g)), dtype=g[0].dtype, device=g[0].device)
                 for g in groups]
        kind = _PeerCopies if transport == "copy-engine" else _AllReduce
        self._transport = kind(ctx, flats, wire_dtype)
        for i, (group, flat) in enumerate(zip(groups, flats, strict=True)):
            wire_views = _views(self._transport.wires[i], group)
            bucket = _Bucket(i, group, flat, _views(flat, group), wire_views)
            self.buckets.append(bucket)
            for p in group:
                self._bucket_of[id(p)] = bucket
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def _on_grad(self, p: nn.Parameter) -> None:
        if not (self.enabled or self._rows_to_optimizer):
            return
        bucket = self._bucket_of[id(p)]
        if id(p) in bucket.ready:
            raise RuntimeError("a parameter received two gradients in one backward: "
                               "GradBuckets needs every parameter used once per step; use DDP")
        bucket.ready.add(id(p))
        if len(bucket.ready) == len(bucket.params):
            self._start(bucket)

    @torch.no_grad()
    def _start(self, bucket: _Bucket) -> None:
        grads = [p.grad for p in bucket.params]
        if self.enabled:
            self._transport.start(bucket.index, bucket.wire_views, grads)
        else:  # paused, for AveragingSGD: this process's own row, without any communication
            _gather(bucket.wire_views, grads)
        bucket.started = True
        if not self._rows_to_optimizer:
            for p, view in zip(bucket.params, bucket.views, strict=True):
                p.grad = view  # filled with the average once the transport is done

    def wait(self) -> None:
        """Order the current stream after every bucket's average (call after backward)."""
        if not (self.enabled or self._rows_to_optimizer):
            return
        missing = sum(len(b.params) - len(b.ready) for b in self.buckets if not b.started)
        if self.enabled and self.buckets:
            with torch.no_grad():
                self._transport.finish()
        for bucket in self.buckets:
            bucket.started = False
            bucket.ready.clear()
        if missing:
            raise RuntimeError(
                f"{missing} parameter(s) got no gradient in this backward: GradBuckets needs "
                "every parameter to take part in every step; use DDP with "
                "find_unused_parameters=True")

    def hand_rows_to_optimizer(self) -> torch.Tensor:
        """Stop averaging here and return the rows (processes x gradients) for the optimizer.

        Used by :class:`AveragingSGD`: backward still fills this process's row and pulls the
        others', but no averaging kernel runs and ``.grad`` keeps each process's own gradient.
        """
        transport = self._transport
        if not isinstance(transport, _PeerCopies):
            raise ValueError("the optimizer can average only the copy-engine transport's rows, "
                             "in a run of several processes: GradBuckets(..., "
                             "transport='copy-engine') under torchrun")
        transport.sum_rows = False
        self._rows_to_optimizer = True
        return transport.rows

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
                _average(t)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def __enter__(self) -> GradBuckets:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AveragingSGD(torch.optim.Optimizer):
    """SGD that takes the average of the gradients itself, in the pass that updates the weights.

    ::

        sync = GradBuckets(net, ctx, transport="copy-engine")
        opt = AveragingSGD(sync, lr=0.1, momentum=0.9, nesterov=True)
        loss.backward()
        sync.wait()  # every process's gradients are side by side in sync's rows
        opt.step()   # one element-wise kernel: average, weight decay, momentum, update

    With the copy-engine transport, backward leaves each process holding every process's
    gradients, one row each. Rather than an averaging kernel per bucket beside backward, this
    optimizer reads the rows in its own element-wise pass (compiled by ``torch.compile`` into
    one kernel), so the averaging costs no pass of its own. For that one kernel to cover every
    parameter, the parameters move into one flat buffer laid out like the rows (values
    unchanged; ``p.data`` becomes a view of it). Under ``sync.pause()`` it applies this
    process's own gradient. The update is PyTorch's SGD (no dampening). The learning rate is
    kept as a tensor on the GPU, as PyTorch's optimizers do with ``lr=torch.tensor(...)``: a
    scheduler updates it in place, and a recorded graph reads the current value.
    """

    def __init__(self, sync: GradBuckets, lr: float | torch.Tensor, momentum: float = 0.0,
                 nesterov: bool = False, weight_decay: float = 0.0,
                 compile: bool = True) -> None:
        if nesterov and momentum <= 0:
            raise ValueError("Nesterov momentum needs momentum > 0")
        rows = sync.hand_rows_to_optimizer()
        params = [p for bucket in sync.buckets for p in bucket.params]
        lr = torch.as_tensor(lr, dtype=torch.float32, device=rows.device)
        super().__init__(params, {"lr": lr, "momentum": momentum, "nesterov": nesterov,
                                  "weight_decay": weight_decay})
        self.sync, self.rows = sync, rows
        self.weights = torch.zeros(rows.shape[1], dtype=params[0].dtype, device=rows.device)
        self.momentum = torch.zeros_like(self.weights)
        # The buckets lie back to back in the rows, so one pass of _views lines them up.
        weights, buffers = _views(self.weights, params), _views(self.momentum, params)
        with torch.no_grad():
            for p, w, m in zip(params, weights, buffers, strict=True):
                w.copy_(p)
                p.data = w
                self.state[p]["momentum_buffer"] = m  # what StepGraph saves and restores
        self._update = (torch.compile(_sgd_from_rows, dynamic=False, fullgraph=True)
                        if compile else _sgd_from_rows)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("AveragingSGD.step takes no closure")
        group = self.param_groups[0]
        if self.sync.enabled:  # every row, in rank order: the same bits on every process
            rows, scale = self.rows, 1 / self.rows.shape[0]
        else:  # paused: this process's own gradient
            rank = self.sync.ctx.rank
            rows, scale = self.rows[rank:rank + 1], 1.0
        self._update(self.weights, self.momentum, rows, group["lr"], scale, group["momentum"],
                     group["nesterov"], group["weight_decay"])


def _sgd_from_rows(weights: torch.Tensor, buf: torch.Tensor, rows: torch.Tensor,
                   lr: torch.Tensor, scale: float, momentum: float, nesterov: bool,
                   weight_decay: float) -> None:
    """One SGD step of ``weights`` with the gradient ``scale * sum(rows)``, in place."""
    grad = rows[0].float()
    for r in range(1, rows.shape[0]):
        grad = grad + rows[r].float()
    grad = grad * scale
    if weight_decay:
        grad = grad + weight_decay * weights
    if momentum:
        buf.mul_(momentum).add_(grad)
        grad = grad + momentum * buf if nesterov else buf
    weights.sub_(lr * grad)


def _gather(wire_views: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    """Copy the gradients into their bucket's slices, rounding them if the wire is narrower."""
    # One multi-tensor copy kernel (a few for many tensors), not one per gradient.
    torch._foreach_copy_(wire_views, grads)


def _average(t: torch.Tensor, async_op: bool = False) -> dist.Work | None:
    """All-reduce ``t`` in place into the mean over the processes."""
    if dist.get_backend() == dist.Backend.NCCL:
        return dist.all_reduce(t, op=dist.ReduceOp.AVG, async_op=async_op)
    t.div_(dist.get_world_size())  # Gloo has no AVG: divide first, then sum
    return dist.all_reduce(t, async_op=async_op)


class _AllReduce:
    """Each bucket averaged by one all-reduce, on the collective's own stream."""

    def __init__(self, ctx: DistContext, flats: list[torch.Tensor],
                 wire_dtype: torch.dtype | None) -> None:
        self.flats = flats
        self.wires = [f if wire_dtype in (None, f.dtype) else f.to(wire_dtype) for f in flats]
        self._work: dict[int, dist.Work] = {}

    def start(self, i: int, wire_views: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        _gather(wire_views, grads)
        self._work[i] = _average(self.wires[i], async_op=True)

    def finish(self) -> None:
        for i, work in self._work.items():
            work.wait()  # on a GPU: a stream dependency, the host does not block
            if self.wires[i] is not self.flats[i]:
                self.flats[i].copy_(self.wires[i])  # widened, in the same layout
        self._work.clear()


class _PeerCopies:
    """Each bucket averaged from the other GPUs' copies of it, pulled by the copy engines.

    ``rows`` (processes x all gradients) is symmetric memory: every process can read every
    other's. Process r writes its gradients into its row r; the other rows of its copy are
    where it pulls the other processes' rows to. Each bucket is a slice of columns.
    """

    TIMEOUT_MS = 600_000  # a barrier waits this long for a missing process, then fails

    def __init__(self, ctx: DistContext, flats: list[torch.Tensor],
                 wire_dtype: torch.dtype | None) -> None:
        from torch.distributed import _symmetric_memory as symm_mem

        self.rank, self.world = ctx.rank, ctx.world_size
        self.total = sum(f.numel() for f in flats)
        dtype = wire_dtype or flats[0].dtype
        self.rows = symm_mem.empty(self.world, self.total, dtype=dtype, device=ctx.device)
        self.rows.zero_()  # the alignment gaps between gradients stay zero
        self.sum_rows = True  # False: the optimizer adds the rows (AveragingSGD)
        self.handle = symm_mem.rendezvous(self.rows, dist.group.WORLD.group_name)
        channels = self.handle.signal_pad_size // (4 * self.world)
        if len(flats) + 1 > channels:
            raise ValueError(f"{len(flats)} buckets need more barrier channels than the "
                             f"{channels} symmetric memory has: use larger buckets")
        self.columns: list[slice] = []
        for f in flats:
            start = self.columns[-1].stop if self.columns else 0
            self.columns.append(slice(start, start + f.numel()))
        self.wires = [self.rows[self.rank, c] for c in self.columns]
        self.flats = flats
        self.stream = torch.cuda.Stream(ctx.device)
        self._held: list[list[torch.Tensor]] = []  # gradients the stream above still reads

    def start(self, i: int, wire_views: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        cols = self.columns[i]
        n = cols.stop - cols.start
        self.stream.wait_stream(torch.cuda.current_stream())  # the bucket's gradients are in
        self._held.append(grads)  # kept alive until finish() joins this stream back
        with torch.cuda.stream(self.stream):
            # Here rather than on the compute stream, the copy into this process's row runs
            # beside the rest of backward, as the pulls do.
            _gather(wire_views, grads)
            if self.sum_rows:
                # Divided here, the average below is a plain sum: one element-wise pass for
                # two GPUs (a mean over the rows would be a reduction kernel, slower than an
                # addition).
                self.wires[i].mul_(1 / self.world)
            self.handle.barrier(channel=i, timeout_ms=self.TIMEOUT_MS)  # everyone's is in
            for peer in range(self.world):
                if peer != self.rank:  # contiguous, same dtype: one DMA copy over the link
                    theirs = self.handle.get_buffer(peer, (n,), self.rows.dtype,
                                                    peer * self.total + cols.start)
                    self.rows[peer, cols].copy_(theirs)
            if self.sum_rows:
                # The same rows added in the same order everywhere: the same bits everywhere.
                torch.add(self.rows[0, cols], self.rows[1, cols], out=self.flats[i])
                for row in range(2, self.world):
                    self.flats[i].add_(self.rows[row, cols])

    def finish(self) -> None:
        with torch.cuda.stream(self.stream):
            # No process may overwrite its row (next step) while another still reads it.
            self.handle.barrier(channel=len(self.columns), timeout_ms=self.TIMEOUT_MS)
        torch.cuda.current_stream().wait_stream(self.stream)
        self._held.clear()  # the copies have been read: backward's gradients may go


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


_ALIGN = 16  # elements: every slice starts 64 (float32) or 32 (bfloat16) bytes aligned


def _span(p: torch.Tensor) -> int:
    """Elements a tensor takes in a bucket: its own, rounded up to keep the next one aligned."""
    return -(-p.numel() // _ALIGN) * _ALIGN


def _views(flat: torch.Tensor, params: list[nn.Parameter]) -> list[torch.Tensor]:
    # Same strides as each parameter (channels_last kernels too), so a gradient copies in as
    # one block and the optimizer reads it in the parameter's own layout.
    views, offset = [], flat.storage_offset()  # as_strided counts from the storage's start
    for p in params:
        views.append(flat.as_strided(p.shape, p.stride(), offset))
        offset += _span(p)
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
