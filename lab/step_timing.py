"""Run under torchrun: time a DDP training step of a Wide-ResNet, with and without all-reduce.

    torchrun --standalone --nproc_per_node=2 -m lab.step_timing \\
        --model wrn-28-10 --batch 128 --out ddp.jsonl

The same step is timed twice: plain DDP (gradients all-reduced in buckets during backward) and
inside ``no_sync()`` (no communication at all: the compute alone). Their difference is the
all-reduce time that backward could not hide. The bus bandwidth of an all-reduce as large as
all the gradients is measured too, for the ring model of chapter 4. ``host_ms`` is how long the
host takes to queue one DDP step: when it nears ``ddp_ms``, the GPU waits for Python.

With ``--capture`` each timed step is one CUDA graph holding the whole step, all-reduces and
optimizer included (:class:`~tutorial_utils.step_graph.StepGraph`); combine it with ``--compile
default`` for fused kernels without torch.compile's own graphs.

``--bucket-mb``, ``--bucket-view`` and ``--bf16-grads`` set how DDP buckets and all-reduces
the gradients (:class:`~lab.ddp_tuning.DDPTuning`). ``--grad-sync buckets``
replaces DDP by the hand-built :class:`~lab.grad_buckets.GradBuckets`
(bucketed all-reduces during backward with fewer kernels; a compiled network is then compiled
child by child so that its gradients come out during backward); ``--bf16-grads`` applies to it
too. ``--grad-sync copy-engine`` is GradBuckets with its copy-engine transport (GPUs only);
add ``--optimizer averaging`` to leave the averaging to
:class:`~lab.grad_buckets.AveragingSGD`'s update.

``--cudnn`` sets how cuDNN picks its convolution algorithms: each process times them once
per shape by default, so two processes can keep different ones; ``heuristics`` gives every
process the same pick.

With ``--trace PATH``, rank 0 also profiles a few DDP steps, writes a Chrome trace (open it in
Perfetto) and adds to its record the GPU time per step spent in kernels and in NCCL.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

from lab.ddp_tuning import DDPTuning
from lab.grad_buckets import AveragingSGD, GradBuckets, compile_children
from tutorial_utils.models import wide_resnet
from tutorial_utils.parallel.ddp import compile_for_ddp, measure_bus_bandwidth
from tutorial_utils.parallel.distributed import DistContext, distributed
from tutorial_utils.step_graph import StepGraph
from tutorial_utils.timing import benchmark, host_clock_without_sync, synchronize


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="wrn-28-10")
    parser.add_argument("--batch", type=int, default=128, help="per-process batch")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--compile", default="none",
                        choices=["none", "default", "reduce-overhead",
                                 "max-autotune-no-cudagraphs"],
                        help="torch.compile mode of the network inside DDP")
    parser.add_argument("--tune-kernels", action="store_true",
                        help="with --compile: coordinate-descent tuning of the generated "
                        "kernels' block sizes")
    parser.add_argument("--optimizer", choices=["foreach", "fused", "averaging"],
                        default="foreach",
                        help="SGD as a few multi-tensor kernels per step (foreach, as "
                        "chapter 2's ladder), one pass over each tensor (fused, as train.py), "
                        "or one pass over all that also averages (with --grad-sync copy-engine)")
    parser.add_argument("--capture", action="store_true",
                        help="record each whole step as one CUDA graph (GPU only)")
    parser.add_argument("--grad-sync", choices=["ddp", "buckets", "copy-engine"],
                        default="ddp", help="who averages the gradients: DDP, GradBuckets "
                        "(all-reduces), or GradBuckets pulling peers' buckets by copy engine")
    parser.add_argument("--bucket-mb", type=float, default=25.0,
                        help="gradient bucket size in MB (DDP or GradBuckets)")
    parser.add_argument("--bucket-view", action="store_true",
                        help="gradients as views into DDP's buckets (no copy)")
    parser.add_argument("--bf16-grads", action="store_true",
                        help="all-reduce the gradients in bfloat16 (DDP or GradBuckets)")
    parser.add_argument("--cudnn", choices=["benchmark", "heuristics", "benchmark-all"],
                        default="benchmark",
                        help="how cuDNN picks each convolution's algorithm: by timing its "
                        "first 10 candidates once each (benchmark, the default), by its "
                        "heuristics alone (the same pick in every process), or by timing "
                        "every candidate")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--trace", type=Path, help="rank 0 writes a profiler trace here")
    args = parser.parse_args(argv)
    if args.grad_sync != "ddp" and args.bucket_view:
        parser.error("--bucket-view is a DDP setting; GradBuckets' gradients are always views "
                     "of its buckets")
    if args.optimizer == "averaging" and args.grad_sync != "copy-engine":
        parser.error("--optimizer averaging adds the rows of the copy-engine transport: add "
                     "--grad-sync copy-engine")
    if args.tune_kernels and args.compile == "none":
        parser.error("--tune-kernels tunes the kernels torch.compile generates: add --compile "
                     "default")

    with distributed(args.device) as ctx:
        # The graphs are released (inner block) before the process group is destroyed.
        with StepGraph(ctx.device, args.capture) as graph, \
                StepGraph(ctx.device, args.capture) as local_graph:
            record = measure(args, ctx, graph, local_graph)
        if ctx.is_main:
            with open(args.out, "a") as f:
                f.write(json.dumps(record) + "\n")


def measure(args: argparse.Namespace, ctx: DistContext, graph: StepGraph,
            local_graph: StepGraph) -> dict:
    """Time the DDP step (in ``graph``) and the same step under ``no_sync`` (``local_graph``)."""
    dev = ctx.device
    torch.backends.cudnn.benchmark = args.cudnn != "heuristics"
    if args.cudnn == "benchmark-all":
        torch.backends.cudnn.benchmark_limit = 0  # 0: no limit
    if args.compile != "none":
        from torch._inductor import config as inductor_config

        inductor_config.coordinate_descent_tuning = args.tune_kernels  # process-wide
    torch.manual_seed(0)
    net = wide_resnet(args.model).to(dev, memory_format=torch.channels_last)
    settings = DDPTuning(args.bucket_mb, args.bucket_view, args.bf16_grads)
    buckets = None
    with graph.stream():  # DDP is built on the stream that will capture it
        if args.grad_sync != "ddp":
            model = compile_children(net, args.compile)
            transport = "copy-engine" if args.grad_sync == "copy-engine" else "all-reduce"
            buckets = GradBuckets(net, ctx, args.bucket_mb,
                                  torch.bfloat16 if args.bf16_grads else None, transport)
        else:
            # Compiled inside DDP; with CUDA graphs as one graph, its gradients all-reduced
            # after backward (compile_for_ddp says why).
            model = settings.wrap(compile_for_ddp(net, args.compile, ctx), ctx)
    # A tensor lr: StepGraph refuses a float for an optimizer stepped inside the graph.
    sgd = dict(lr=torch.tensor(0.01, device=dev), momentum=0.9, nesterov=True)
    if args.optimizer == "averaging":
        opt = AveragingSGD(buckets, **sgd)
    else:
        fused = args.optimizer == "fused"
        opt = torch.optim.SGD(net.parameters(), **sgd, fused=fused or None,
                              foreach=not fused or None)
    x = torch.randn(args.batch, 3, 32, 32, device=dev).to(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (args.batch,), device=dev)
    bf16 = dev.type == "cuda"

    def no_communication():
        if not ctx.is_distributed:
            return contextlib.nullcontext()
        return buckets.pause() if buckets else model.no_sync()

    def body(sync: bool) -> None:  # one step (StepGraph clears the gradients before it)
        with contextlib.nullcontext() if sync else no_communication():
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16,
                                cache_enabled=False):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            if buckets:
                buckets.wait()
        opt.step()

    step = graph.capture(lambda: body(sync=True), net, opt)
    with_ddp = benchmark(step, warmup=args.warmup, repeats=args.repeats, device=dev)
    compute_step = local_graph.capture(lambda: body(sync=False), net, opt)
    compute = benchmark(compute_step, warmup=2, repeats=args.repeats, device=dev)
    grad_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
    busbw = measure_bus_bandwidth(ctx, grad_bytes) if ctx.is_distributed else None
    synchronize(dev)
    host = host_clock_without_sync(step, repeats=5)
    synchronize(dev)
    record = {
        "world_size": ctx.world_size, "model": args.model, "compile": args.compile,
        "optimizer": args.optimizer, "tune_kernels": args.tune_kernels,
        "capture": args.capture, "grad_sync": args.grad_sync, "cudnn": args.cudnn,
        "per_gpu_batch": args.batch,
        "ddp_ms": with_ddp.median_ms,
        "ddp_spread": with_ddp.spread, "no_sync_ms": compute.median_ms,
        "host_ms": host.median_ms, "ddp_tuning": asdict(settings),
        "grad_bytes": grad_bytes, "bus_gbps": busbw,
        "device": str(dev),
    }
    if args.trace:
        record |= profile_steps(step, dev, args.trace if ctx.is_main else None)
    return record


def profile_steps(step, device: torch.device, trace: Path | None, steps: int = 5) -> dict:
    """Profile ``steps`` calls of ``step``; GPU milliseconds per step in kernels and in NCCL.

    Only the GPU's own kernel and copy events count: CPU operators and annotations carry the
    device time of the kernels under them and would count it again. Kernels that run at the
    same time (NCCL beside backward) are summed, not merged. Every rank runs the profiled
    steps (their collectives must match); only a rank given a ``trace`` path writes the
    Chrome trace.
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        synchronize(device)
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    on_gpu = [e for e in prof.events()
              if e.device_type == DeviceType.CUDA and not e.is_user_annotation]

    def per_step_ms(events) -> float:
        return sum(e.time_range.elapsed_us() for e in events) / steps / 1e3

    nccl = [e for e in on_gpu if "nccl" in e.name.lower()]
    return {"gpu_kernels_ms": per_step_ms(on_gpu) - per_step_ms(nccl),
            "gpu_nccl_ms": per_step_ms(nccl)}


if __name__ == "__main__":
    main()
