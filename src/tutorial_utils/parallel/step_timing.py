"""Run under torchrun: time a DDP training step of a Wide-ResNet, with and without all-reduce.

    torchrun --standalone --nproc_per_node=2 -m tutorial_utils.parallel.step_timing \\
        --model wrn-28-10 --batch 128 --out ddp.jsonl

The same step is timed twice: plain DDP (gradients all-reduced in buckets during backward) and
inside ``no_sync()`` (no communication at all: the compute alone). Their difference is the
all-reduce time that backward could not hide. The bus bandwidth of an all-reduce as large as
all the gradients is measured too, for the ring model of chapter 4.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from ..models import wide_resnet
from ..timing import benchmark
from .data_parallel import compile_for_ddp, ddp, measure_bus_bandwidth
from .distributed import distributed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="wrn-28-10")
    parser.add_argument("--batch", type=int, default=128, help="per-process batch")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--compile", choices=["none", "default", "reduce-overhead"],
                        default="none", help="torch.compile mode of the network inside DDP")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    with distributed(args.device) as ctx:
        dev = ctx.device
        torch.backends.cudnn.benchmark = True
        torch.manual_seed(0)
        net = wide_resnet(args.model).to(dev, memory_format=torch.channels_last)
        # Compiled inside DDP; with CUDA graphs as one graph, its gradients all-reduced after
        # backward (compile_for_ddp says why).
        model = ddp(compile_for_ddp(net, args.compile, ctx), ctx)
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9, nesterov=True)
        x = torch.randn(args.batch, 3, 32, 32, device=dev).to(memory_format=torch.channels_last)
        y = torch.randint(0, 10, (args.batch,), device=dev)

        bf16 = dev.type == "cuda"

        def step(sync: bool = True) -> None:
            with contextlib.nullcontext() if sync else model.no_sync():
                with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
                    loss = F.cross_entropy(model(x), y)
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        with_ddp = benchmark(step, warmup=args.warmup, repeats=args.repeats, device=dev)
        compute = benchmark(lambda: step(sync=False), warmup=2, repeats=args.repeats, device=dev)
        grad_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
        busbw = measure_bus_bandwidth(ctx, grad_bytes)
        if ctx.is_main:
            with open(args.out, "a") as f:
                f.write(json.dumps({
                    "world_size": ctx.world_size, "model": args.model, "compile": args.compile,
                    "per_gpu_batch": args.batch, "ddp_ms": with_ddp.median_ms,
                    "ddp_spread": with_ddp.spread, "no_sync_ms": compute.median_ms,
                    "grad_bytes": grad_bytes, "bus_gbps": busbw, "device": str(dev),
                }) + "\n")


if __name__ == "__main__":
    main()
