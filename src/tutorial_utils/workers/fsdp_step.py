"""Run under torchrun: DDP and FSDP2 on the same model and data, memory and step time.

    torchrun --standalone --nproc_per_node=2 -m tutorial_utils.workers.fsdp_step \\
        --model wrn-28-10 --batch 128 --repeats 10 --out fsdp.jsonl

Rank 0 writes one JSON line per mode: the bytes this rank holds for parameters, gradients and
optimizer state, the losses of the first steps (the two modes must agree), the step time and
the peak memory.
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from ..models import wide_resnet
from ..parallel.ddp import ddp
from ..parallel.distributed import DistContext, distributed
from ..parallel.fsdp import local_bytes, shard
from ..timing import benchmark


def measure(mode: str, ctx: DistContext, args: argparse.Namespace) -> dict:
    dev = ctx.device
    if dev.type == "cuda":
        gc.collect()  # the previous mode's model may sit in a reference cycle
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    torch.manual_seed(0)  # same weights in both modes
    # FSDP2 shards contiguous parameters only, so neither mode converts the weights to
    # channels_last; the inputs still are.
    net = wide_resnet(args.model).to(dev)
    model = shard(net, ctx) if mode == "fsdp" else ddp(net, ctx)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1 + ctx.rank)  # each rank its own data, same per mode
    batches = [(torch.randn(args.batch, 3, 32, 32, generator=g).to(dev),
                torch.randint(0, 10, (args.batch,), generator=g).to(dev)) for _ in range(2)]
    losses: list[float] = []

    def step(i: int = 0) -> torch.Tensor:
        x, y = batches[i % 2]
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            loss = F.cross_entropy(model(x.to(memory_format=torch.channels_last)), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # keep gradients allocated: they count in memory
        return loss

    for i in range(args.steps):
        losses.append(float(step(i)))
    record = {"mode": mode, "losses": losses, **local_bytes(model, opt)}
    if args.repeats:
        record["step_ms"] = benchmark(step, warmup=2, repeats=args.repeats, device=dev).median_ms
        record["images_per_s"] = args.batch * ctx.world_size / record["step_ms"] * 1e3
    if dev.type == "cuda":
        record["peak_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
    return record


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="wrn-28-10")
    parser.add_argument("--batch", type=int, default=128, help="per-process batch")
    parser.add_argument("--steps", type=int, default=3, help="training steps compared")
    parser.add_argument("--repeats", type=int, default=0, help="timed steps (0: none)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    with distributed(args.device) as ctx:
        records = [measure(mode, ctx, args) for mode in ("ddp", "fsdp")]
        if ctx.is_main:
            with open(args.out, "a") as f:
                for r in records:
                    f.write(json.dumps({"world_size": ctx.world_size, "model": args.model,
                                        "per_gpu_batch": args.batch, **r}) + "\n")


if __name__ == "__main__":
    main()
