"""Run under torchrun: time a DDP training step of a Wide-ResNet, with and without all-reduce.

    torchrun --standalone --nproc_per_node=2 -m tutorial_utils.bench.workers.step_timing \\
        --model wrn-28-10 --batch 128 --out ddp.jsonl

The same step is timed twice: plain DDP (gradients all-reduced in buckets during backward) and
inside ``no_sync()`` (no communication at all: the compute alone). Their difference is the
all-reduce time that backward could not hide. The bus bandwidth of an all-reduce as large as
all the gradients is measured too, for the ring model of chapter 4. ``host_ms`` is how long the
host takes to queue one DDP step: when it nears ``ddp_ms``, the GPU waits for Python.

With ``--capture`` each timed step is one CUDA graph holding the whole step, all-reduces and
optimizer included (:class:`~tutorial_utils.step_graph.StepGraph`); combine it with
``--compile default`` for fused kernels without torch.compile's own graphs. With ``--trace
PATH`` rank 0 also writes a profiler trace of a few DDP steps (open it in Perfetto). Every
option: :class:`StepTimingConfig`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from ...config import check, opt, parse_or_exit
from ...jsonl import write_jsonl
from ...models.wrn import wide_resnet
from ...parallel.collectives import measure_bus_bandwidth
from ...parallel.ddp import compile_for_ddp, ddp
from ...parallel.distributed import DistContext, distributed
from ...step import forward_loss
from ...step_graph import StepGraph
from ...timing import benchmark, host_clock_without_sync, synchronize
from ..timeline import profile_steps
from ..workload import Workload


@dataclass
class StepTimingConfig(Workload):
    """Time a DDP training step of a Wide-ResNet, with and without its all-reduce."""

    device: Literal["auto", "cpu", "cuda"] = opt("auto", "cuda needs one GPU per process")
    compile: Literal["none", "default", "reduce-overhead"] = opt(
        "none", "torch.compile mode of the network inside DDP")
    optimizer: Literal["foreach", "fused"] = opt(
        "foreach", "SGD as a few multi-tensor kernels (as chapter 2's ladder) or one pass over "
        "each tensor (as train.py)")
    capture: bool = opt(False, "record each whole step as one CUDA graph (GPU only; with "
                        "--optimizer fused)")
    trace: Path | None = opt(None, "rank 0 also writes a profiler trace of a few steps here")
    out: Path = opt(Path("runs/step_timing.jsonl"), "rank 0 appends its row here")

    def __post_init__(self) -> None:
        super().__post_init__()
        check((not self.capture or self.optimizer == "fused",
               "--capture records the optimizer step too, which must read its lr from a tensor "
               "on the GPU: add --optimizer fused (foreach SGD bakes the lr in)"))


@dataclass
class StepTiming:
    """Rank 0's row: the DDP step, the same step without communication, and the link."""

    ddp_ms: float  # median
    ddp_spread: float | None  # interquartile range over the median
    host_ms: float | None  # the host's time to queue one step
    no_sync_ms: float  # the step inside no_sync(): the compute alone
    grad_bytes: int
    bus_gbps: float | None  # an all-reduce as large as the gradients (None: one process)
    world_size: int
    model: str
    compile: str
    optimizer: str
    capture: bool
    per_gpu_batch: int
    device: str
    # with --trace: GPU time per step in kernels and in NCCL, collectives launched per step
    gpu_kernels_ms: float | None = None
    gpu_nccl_ms: float | None = None
    all_reduces: float | None = None
    broadcasts: float | None = None


def main(argv: list[str] | None = None) -> None:
    cfg = parse_or_exit(StepTimingConfig, argv, __spec__.name)
    with distributed(cfg.device) as ctx:
        # The graphs are released (inner block) before the process group is destroyed.
        with StepGraph(ctx.device, cfg.capture) as graph, \
                StepGraph(ctx.device, cfg.capture) as local_graph:
            row = measure(cfg, ctx, graph, local_graph)
        if ctx.is_main:
            write_jsonl(cfg.out, [dataclasses.asdict(row)])


def measure(cfg: StepTimingConfig, ctx: DistContext, graph: StepGraph,
            local_graph: StepGraph) -> StepTiming:
    """Time the DDP step (in ``graph``) and the same step under ``no_sync`` (``local_graph``)."""
    dev = ctx.device
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    net = wide_resnet(cfg.model).to(dev, memory_format=torch.channels_last)
    with graph.stream():  # DDP is built on the stream that will capture it
        model = ddp(compile_for_ddp(net, cfg.compile, ctx), ctx)
    opt = make_optimizer(cfg, net)
    x = torch.randn(cfg.batch, 3, 32, 32, device=dev).to(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (cfg.batch,), device=dev)

    def body(sync: bool) -> None:  # one step
        quiet = ctx.is_distributed and not sync
        with model.no_sync() if quiet else contextlib.nullcontext():
            forward_loss(model, x, y, "bf16" if dev.type == "cuda" else "fp32")[1].backward()
        opt.step()

    def step_of(body_: Callable[[], None], g: StepGraph) -> Callable[[], None]:
        """The step recorded in ``g`` (which clears the gradients itself), or run eagerly."""
        if cfg.capture:
            return g.capture(body_, net, opt)

        def eager() -> None:
            opt.zero_grad(set_to_none=True)
            body_()
        return eager

    record = time_ddp_step(step_of(lambda: body(sync=True), graph), cfg, ctx)
    # The no_sync step last: each captured graph writes gradients of its own, and capturing
    # this one hands the parameters its gradients, so the DDP graph is not replayed after it.
    compute = benchmark(step_of(lambda: body(sync=False), local_graph), warmup=2,
                        repeats=cfg.repeats, device=dev)
    grad_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
    busbw = measure_bus_bandwidth(grad_bytes, dev) if ctx.is_distributed else None
    return StepTiming(**record, no_sync_ms=compute.median_ms, grad_bytes=grad_bytes,
                      bus_gbps=busbw, world_size=ctx.world_size, model=cfg.model,
                      compile=cfg.compile, optimizer=cfg.optimizer, capture=cfg.capture,
                      per_gpu_batch=cfg.batch, device=str(dev))


def make_optimizer(cfg: StepTimingConfig, net: torch.nn.Module) -> torch.optim.SGD:
    """SGD with Nesterov momentum, its kernels chosen by ``cfg.optimizer``.

    A step recorded as a CUDA graph must read its learning rate from a tensor on the GPU
    (:class:`~tutorial_utils.step_graph.StepGraph` refuses a float). An eager step gets a float:
    foreach SGD turns a tensor lr into a Python number on every step (``alpha=-lr``), a
    synchronisation that empties the GPU's queue (chapter 2 measures what it costs).
    """
    dev = next(net.parameters()).device
    fused = cfg.optimizer == "fused"
    lr = torch.tensor(0.01, device=dev) if cfg.capture else 0.01
    return torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9, nesterov=True,
                           fused=fused or None, foreach=not fused or None)


def time_ddp_step(step, cfg: StepTimingConfig, ctx: DistContext) -> dict:
    """The DDP step's median time and spread, the host's queueing time of one step, and with
    ``cfg.trace`` a profile of a few steps (every rank profiles; rank 0 writes the trace)."""
    timed = benchmark(step, warmup=cfg.warmup, repeats=cfg.repeats, device=ctx.device)
    synchronize(ctx.device)  # the host clock below times the queueing of one step alone
    host = host_clock_without_sync(step, repeats=5)
    synchronize(ctx.device)
    record = {"ddp_ms": timed.median_ms, "ddp_spread": timed.spread, "host_ms": host.median_ms}
    if cfg.trace:
        record |= profile_steps(step, ctx.device, cfg.trace if ctx.is_main else None)
    return record


if __name__ == "__main__":
    main()
