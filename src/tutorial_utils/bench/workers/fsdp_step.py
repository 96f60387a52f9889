"""Run under torchrun: DDP and the ZeRO stages on the same model and data, state and step time.

    torchrun --standalone --nproc_per_node=2 -m tutorial_utils.bench.workers.fsdp_step \\
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

import gc
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

from ...config import Config, check, check_wrn, opt, parse_or_exit
from ...jsonl import write_jsonl
from ...models import wide_resnet
from ...parallel.ddp import ddp
from ...parallel.distributed import DistContext, distributed
from ...parallel.fsdp import compile_blocks_of, local_bytes, shard
from ...timing import benchmark, host_clock_without_sync, synchronize
from ...trainer import forward_loss
from ..timeline import profile_steps

MODES = ("ddp", "zero1", "zero2", "zero3", "zero3-blocks")
Mode = Literal["ddp", "zero1", "zero2", "zero3", "zero3-blocks"]


@dataclass
class FsdpStepConfig(Config):
    """Run under torchrun: DDP and the ZeRO stages on the same model and data, state and time."""

    model: str = opt("wrn-28-10", "the network, WRN-depth-width")
    batch: int = opt(128, "images per process")
    modes: tuple[Mode, ...] = opt(MODES, "the modes to compare, in these processes")
    steps: int = opt(3, "training steps whose losses are compared")
    repeats: int = opt(0, "timed steps (0: none)")
    compile: bool = opt(False, "compile each residual block (GPU)")
    units: Literal["model", "group", "block"] = opt("group", "the FSDP units besides the root")
    prefetch: bool = opt(False, "explicit FSDP prefetching")
    fit_gib: float | None = opt(None, "cap each process's GPU memory (GiB): can it train?")
    trace: Path | None = opt(None, "rank 0 writes DIR/<mode>.json profiler traces")
    device: Literal["auto", "cpu", "cuda"] = opt("auto", "cuda needs one GPU per process")
    out: Path = opt(Path("runs/fsdp.jsonl"), "rank 0 appends one JSON line per mode here")

    def __post_init__(self) -> None:
        check_wrn(self.model)
        check((self.batch >= 1, f"--batch must be >= 1, got {self.batch}"),
              (bool(self.modes), "--modes needs at least one mode"),
              (self.steps >= 1 and self.repeats >= 0, "need --steps >= 1 and --repeats >= 0"),
              (self.fit_gib is None or self.fit_gib > 0, "--fit-gib must be > 0"),
              # an out-of-memory error can leave memory behind for the next mode
              (not self.fit_gib or len(self.modes) == 1,
               "--fit-gib takes one mode per job, so no failed attempt affects the next"))


def build(mode: str, ctx: DistContext, args: FsdpStepConfig):
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


def measure(mode: str, ctx: DistContext, args: FsdpStepConfig) -> dict:
    dev = ctx.device
    gc.collect()  # forget the previous mode: its model may sit in a reference cycle
    if args.compile:
        torch.compiler.reset()  # else each mode adds variants until the cache limit is hit
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    model, optimizer = build(mode, ctx, args)
    g = torch.Generator().manual_seed(1 + ctx.rank)  # each rank its own data, same per mode
    batches = [(torch.randn(args.batch, 3, 32, 32, generator=g).to(dev)
                .to(memory_format=torch.channels_last),
                torch.randint(0, 10, (args.batch,), generator=g).to(dev)) for _ in range(2)]

    def step(i: int = 0) -> torch.Tensor:
        x, y = batches[i % 2]
        optimizer.zero_grad(set_to_none=True)  # first, so the gradients stay for local_bytes
        _, loss = forward_loss(model, x, y, "bf16" if dev.type == "cuda" else "fp32")
        loss.backward()
        optimizer.step()
        return loss.detach()

    # ZeroRedundancyOptimizer wraps a local SGD
    sgd = getattr(optimizer, "optim", optimizer).defaults
    record = {"mode": mode, "sgd": next((k for k in ("fused", "foreach") if sgd[k]), "loop")}
    try:
        record["losses"] = [float(step(i)) for i in range(args.steps)]
    except torch.cuda.OutOfMemoryError:  # every rank runs the same shapes: all fail alike
        return record | {"fits": False}
    record |= {"fits": True, **local_bytes(model, optimizer)}
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


def main(argv: list[str] | None = None) -> None:
    args = parse_or_exit(FsdpStepConfig, argv, __spec__.name)
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
