"""Run under torchrun: DDP and the ZeRO stages on the same model and data, state and step time.

    torchrun --standalone --nproc_per_node=2 -m tutorial_utils.workers.fsdp_step \\
        --model wrn-28-10 --batch 128 --repeats 20 --trace runs/fsdp-trace --out fsdp.jsonl

The modes run in the same processes, treated alike (bf16 autocast, cuDNN autotuning,
channels_last inputs, ``--compile`` per residual block, SGD fused where its kernel takes the
parameters): ``ddp``; ``zero1`` (ZeroRedundancyOptimizer over DDP); ``zero2`` and ``zero3``
(FSDP2 without and with resharding after forward, ``--units`` per WRN group by default);
``zero3-blocks`` (a unit per block). Rank 0 writes a JSON line per mode: the bytes this rank
holds, the first losses, the median step time (CUDA events, after warm-up), the peak memory.
``--fit-gib G`` caps each process's GPU memory at G GiB: can the mode train at all?
"""

from __future__ import annotations

import argparse
import gc
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer

from ..models import wide_resnet
from ..parallel.ddp import ddp
from ..parallel.distributed import DistContext, distributed
from ..parallel.fsdp import compile_blocks_of, local_bytes, shard
from ..report import write_jsonl
from ..timeline import profile_steps
from ..timing import benchmark, host_clock_without_sync, synchronize

MODES = ("ddp", "zero1", "zero2", "zero3", "zero3-blocks")


def build(mode: str, ctx: DistContext, args: argparse.Namespace):
    """The model and optimizer of one mode, from the same initial weights."""
    torch.manual_seed(0)
    # FSDP2 gathers parameters into contiguous tensors, so no mode makes the weights
    # channels_last: cuDNN converts them per convolution, in every mode alike.
    net = wide_resnet(args.model).to(ctx.device)
    on_gpu = ctx.device.type == "cuda"
    if mode in ("ddp", "zero1"):
        if args.compile:
            compile_blocks_of([net])
        model = ddp(net, ctx, gradient_as_bucket_view=True)  # no second copy of the grads
        sgd = {"lr": 0.05, "momentum": 0.9, "fused": on_gpu or None}
        if mode == "zero1" and ctx.is_distributed:
            return model, ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, **sgd)
    else:
        model = shard(net, ctx, units="block" if mode == "zero3-blocks" else args.units,
                      reshard_after_forward=mode != "zero2", prefetch=args.prefetch,
                      compile_blocks=args.compile)
        # DTensor has no sharding rule for fused SGD's kernel (it has one for fused Adam):
        # the sharded parameters take the multi-tensor (foreach) kernels instead.
        sgd = {"lr": 0.05, "momentum": 0.9, "foreach": on_gpu or None}
    return model, torch.optim.SGD(model.parameters(), **sgd)


def measure(mode: str, ctx: DistContext, args: argparse.Namespace) -> dict:
    dev = ctx.device
    gc.collect()  # forget the previous mode: its model may sit in a reference cycle
    if args.compile:
        torch.compiler.reset()  # else each mode adds variants until the cache limit is hit
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    model, opt = build(mode, ctx, args)
    g = torch.Generator().manual_seed(1 + ctx.rank)  # each rank its own data, same per mode
    batches = [(torch.randn(args.batch, 3, 32, 32, generator=g).to(dev)
                .to(memory_format=torch.channels_last),
                torch.randint(0, 10, (args.batch,), generator=g).to(dev)) for _ in range(2)]

    def step(i: int = 0) -> torch.Tensor:
        x, y = batches[i % 2]
        opt.zero_grad(set_to_none=True)  # first, so the gradients stay for local_bytes
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    sgd = getattr(opt, "optim", opt).defaults  # ZeroRedundancyOptimizer wraps a local SGD
    record = {"mode": mode, "sgd": next((k for k in ("fused", "foreach") if sgd[k]), "loop")}
    try:
        record["losses"] = [float(step(i)) for i in range(args.steps)]
    except torch.cuda.OutOfMemoryError:  # every rank runs the same shapes: all fail alike
        return record | {"fits": False}
    record |= {"fits": True, **local_bytes(model, opt)}
    if args.repeats:
        t = benchmark(step, warmup=5, repeats=args.repeats, device=dev)
        record |= {"step_ms": t.median_ms, "step_spread": t.spread,
                   "images_per_s": args.batch * ctx.world_size / t.median_ms * 1e3}
        synchronize(dev)  # the host clock below times the queueing of one step alone
        record["host_ms"] = host_clock_without_sync(step, repeats=5).median_ms
        synchronize(dev)
    if args.trace:  # every rank profiles (collectives must match), rank 0 writes
        args.trace.mkdir(parents=True, exist_ok=True)
        record |= profile_steps(step, dev, args.trace / f"{mode}.json" if ctx.is_main else None)
    if dev.type == "cuda":
        record["peak_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
    return record


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="wrn-28-10")
    parser.add_argument("--batch", type=int, default=128, help="per-process batch")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--steps", type=int, default=3, help="training steps compared")
    parser.add_argument("--repeats", type=int, default=0, help="timed steps (0: none)")
    parser.add_argument("--compile", action="store_true", help="compile each block (GPU)")
    parser.add_argument("--units", choices=["model", "group", "block"], default="group")
    parser.add_argument("--prefetch", action="store_true", help="explicit FSDP prefetching")
    parser.add_argument("--fit-gib", type=float, help="cap each process's GPU memory (GiB)")
    parser.add_argument("--trace", type=Path, help="rank 0 writes DIR/<mode>.json traces")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.fit_gib and len(args.modes) > 1:  # an out-of-memory error can leave memory behind
        parser.error("--fit-gib takes one mode per job, so no failed attempt affects the next")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with distributed(args.device) as ctx:
        dev = ctx.device
        gpu_only = (args.compile or args.fit_gib) and dev.type != "cuda"
        if args.fit_gib and not gpu_only:  # before the first allocation, for every mode
            total = torch.cuda.get_device_properties(dev).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, args.fit_gib * 2**30 / total))
        torch.backends.cudnn.benchmark = True
        # 1x1 convolutions' gradients come out channels_last, the same memory order: harmless
        warnings.filterwarnings("ignore", "Grad strides do not match bucket view strides")
        records = [{"mode": m, "skipped": "needs CUDA GPUs"} if gpu_only
                   else measure(m, ctx, args) for m in args.modes]
        if ctx.is_main:
            if gpu_only:
                print(f"skipped: --compile and --fit-gib need CUDA GPUs; this job has {dev}")
            common = {"world_size": ctx.world_size, "device": str(dev), "model": args.model,
                      "per_gpu_batch": args.batch, **{k: getattr(args, k) for k in
                                                      ("units", "compile", "prefetch", "fit_gib")}}
            write_jsonl(args.out, [common | r for r in records])


if __name__ == "__main__":
    main()
