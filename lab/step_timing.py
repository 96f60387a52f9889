"""Run under torchrun: time a DDP training step of a Wide-ResNet, with and without all-reduce.

    torchrun --standalone --nproc_per_node=2 -m lab.step_timing \\
        --model wrn-28-10 --batch 128 --out ddp.jsonl

The research version of :mod:`tutorial_utils.workers.step_timing` (same record, same
``--capture`` and ``--trace``), with the options the campaign measured:

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

"""

from __future__ import annotations

import argparse
import contextlib
from dataclasses import asdict

import torch
import torch.nn.functional as F

from lab.ddp_tuning import DDPTuning
from lab.grad_buckets import AveragingSGD, GradBuckets, compile_children
from tutorial_utils.models import wide_resnet
from tutorial_utils.parallel.ddp import compile_for_ddp
from tutorial_utils.parallel.distributed import DistContext
from tutorial_utils.step_graph import StepGraph
from tutorial_utils.timeline import profile_steps
from tutorial_utils.workers.step_timing import base_parser, run, time_both


def main(argv: list[str] | None = None) -> None:
    parser = base_parser(__doc__.splitlines()[0])
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

    run(args, measure)


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

    timed, step = time_both(ctx, net, opt, body, graph, local_graph, args)
    record = timed | {
        "world_size": ctx.world_size, "model": args.model, "compile": args.compile,
        "optimizer": args.optimizer, "tune_kernels": args.tune_kernels,
        "capture": args.capture, "grad_sync": args.grad_sync, "cudnn": args.cudnn,
        "per_gpu_batch": args.batch, "ddp_tuning": asdict(settings), "device": str(dev),
    }
    if args.trace:
        record |= profile_steps(step, dev, args.trace if ctx.is_main else None)
    return record


if __name__ == "__main__":
    main()
