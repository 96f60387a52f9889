"""Run under torchrun: time a DDP training step of a Wide-ResNet, with and without all-reduce.

    torchrun --standalone --nproc_per_node=2 -m tutorial_utils.workers.step_timing \\
        --model wrn-28-10 --batch 128 --out ddp.jsonl

The same step is timed twice: plain DDP (gradients all-reduced in buckets during backward) and
inside ``no_sync()`` (no communication at all: the compute alone). Their difference is the
all-reduce time that backward could not hide. The bus bandwidth of an all-reduce as large as
all the gradients is measured too, for the ring model of chapter 4. ``host_ms`` is how long the
host takes to queue one DDP step: when it nears ``ddp_ms``, the GPU waits for Python.

With ``--capture`` each timed step is one CUDA graph holding the whole step, all-reduces and
optimizer included (:class:`~tutorial_utils.step_graph.StepGraph`); combine it with
``--compile default`` for fused kernels without torch.compile's own graphs. With ``--trace
PATH`` rank 0 also writes a profiler trace of a few DDP steps (open it in Perfetto).
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

import torch
import torch.nn.functional as F

from ..models import wide_resnet
from ..parallel.ddp import compile_for_ddp, ddp, measure_bus_bandwidth
from ..parallel.distributed import DistContext, distributed
from ..report import write_jsonl
from ..step_graph import StepGraph
from ..timeline import profile_steps
from ..timing import benchmark, host_clock_without_sync, synchronize


def base_parser(description: str) -> argparse.ArgumentParser:
    """The options every step-timing worker shares: the workload, the repeats, where to write."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default="wrn-28-10")
    parser.add_argument("--batch", type=int, default=128, help="per-process batch")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--trace", type=Path, help="rank 0 writes a profiler trace here")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--compile", default="none", choices=["none", "default", "reduce-overhead"],
                        help="torch.compile mode of the network inside DDP")
    parser.add_argument("--optimizer", choices=["foreach", "fused"], default="foreach",
                        help="SGD as a few multi-tensor kernels (as chapter 2's ladder) or one "
                        "pass over each tensor (as train.py)")
    parser.add_argument("--capture", action="store_true",
                        help="record each whole step as one CUDA graph (GPU only; with "
                        "--optimizer fused)")
    args = parser.parse_args(argv)
    if args.capture and args.optimizer != "fused":
        parser.error("--capture records the optimizer step too, which must read its lr from "
                     "a tensor on the GPU: add --optimizer fused (foreach SGD bakes the lr in)")
    return args


def main(argv: list[str] | None = None) -> None:
    run(parse_args(argv), measure)


def run(args: argparse.Namespace, measure_fn) -> None:
    """In the process group: ``measure_fn(args, ctx, graph, local_graph)``; rank 0 writes it."""
    with distributed(args.device) as ctx:
        # The graphs are released (inner block) before the process group is destroyed.
        with StepGraph(ctx.device, args.capture) as graph, \
                StepGraph(ctx.device, args.capture) as local_graph:
            record = measure_fn(args, ctx, graph, local_graph)
        if ctx.is_main:
            write_jsonl(args.out, [record])


def measure(args: argparse.Namespace, ctx: DistContext, graph: StepGraph,
            local_graph: StepGraph) -> dict:
    """Time the DDP step (in ``graph``) and the same step under ``no_sync`` (``local_graph``)."""
    dev = ctx.device
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    net = wide_resnet(args.model).to(dev, memory_format=torch.channels_last)
    with graph.stream():  # DDP is built on the stream that will capture it
        model = ddp(compile_for_ddp(net, args.compile, ctx), ctx)
    fused = args.optimizer == "fused"
    # A tensor lr: the optimizer step may be recorded in the graph (StepGraph refuses a float).
    opt = torch.optim.SGD(net.parameters(), lr=torch.tensor(0.01, device=dev), momentum=0.9,
                          nesterov=True, fused=fused or None, foreach=not fused or None)
    x = torch.randn(args.batch, 3, 32, 32, device=dev).to(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (args.batch,), device=dev)

    def body(sync: bool) -> None:  # one step (StepGraph clears the gradients before it)
        quiet = ctx.is_distributed and not sync
        with model.no_sync() if quiet else contextlib.nullcontext():
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda",
                                cache_enabled=False):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
        opt.step()

    record, step = time_both(ctx, net, opt, body, graph, local_graph, args)
    record |= {"world_size": ctx.world_size, "model": args.model, "compile": args.compile,
               "optimizer": args.optimizer, "capture": args.capture,
               "per_gpu_batch": args.batch, "device": str(dev)}
    if args.trace:
        record |= profile_steps(step, dev, args.trace if ctx.is_main else None)
    return record


def time_both(ctx: DistContext, net, opt, body, graph: StepGraph, local_graph: StepGraph,
              args: argparse.Namespace) -> tuple[dict, object]:
    """``body(sync=True)`` (DDP) and ``body(sync=False)`` (no communication) captured and
    timed, the bus bandwidth of an all-reduce of every gradient, and the host's queueing time
    of one DDP step; those record fields, and the DDP step itself."""
    step = graph.capture(lambda: body(sync=True), net, opt)
    with_ddp = benchmark(step, warmup=args.warmup, repeats=args.repeats, device=ctx.device)
    compute = benchmark(local_graph.capture(lambda: body(sync=False), net, opt), warmup=2,
                        repeats=args.repeats, device=ctx.device)
    grad_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
    busbw = measure_bus_bandwidth(ctx, grad_bytes) if ctx.is_distributed else None
    synchronize(ctx.device)
    host = host_clock_without_sync(step, repeats=5)
    synchronize(ctx.device)
    return {"ddp_ms": with_ddp.median_ms, "ddp_spread": with_ddp.spread,
            "no_sync_ms": compute.median_ms, "host_ms": host.median_ms,
            "grad_bytes": grad_bytes, "bus_gbps": busbw}, step


if __name__ == "__main__":
    main()
