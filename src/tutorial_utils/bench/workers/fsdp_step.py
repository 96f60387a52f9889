"""Run under torchrun: DDP and the ZeRO stages on the same model and data, state and step time.

    torchrun --standalone --nproc_per_node=2 -m tutorial_utils.bench.workers.fsdp_step \\
        --model wrn-28-10 --batch 128 --repeats 20 --variants eager blocks model graph \\
        --out fsdp.jsonl

The modes run in the same processes, treated alike (bf16 autocast, cuDNN autotuning,
channels_last inputs, SGD fused where its kernel takes the parameters): ``ddp``; ``zero1``
(ZeroRedundancyOptimizer over DDP); ``zero2`` and ``zero3`` (FSDP2 without and with resharding
after forward, ``--units`` per WRN group by default); ``zero3-blocks`` (a unit per block).
Each mode runs in every one of ``--variants`` that composes with it: ``eager``; ``blocks``
(``torch.compile`` per residual block, before wrapping); ``model`` (the whole network compiled:
under FSDP2, dynamo runs FSDP's hooks eagerly and so cuts the graph at every unit); ``graph``
(DDP only: the whole step, all-reduces and optimizer included, recorded as one CUDA graph with
the compiled network inside, :class:`~tutorial_utils.step_graph.StepGraph`).

One process forms a process group of one, so that DDP and FSDP2 wrap the model as they would
on N GPUs: what it measures is their host work, with nothing to communicate. Rank 0 writes a
JSON line per mode and variant: the bytes this rank holds, the first losses, the median step
time (CUDA events, after warm-up), the host's time to queue one step, the peak memory.
``--fit-gib G`` caps each process's GPU memory at G GiB: can the mode train at all?
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from ...config import Config, check, check_wrn, opt, parse_or_exit
from ...jsonl import write_jsonl
from ...models.wrn import wide_resnet
from ...parallel.distributed import DistContext, distributed
from ...parallel.fsdp import compile_blocks_of, local_bytes, shard
from ...step import forward_loss
from ...step_graph import StepGraph
from ..timeline import profile_steps
from .common import fresh_batches, group_of_one, time_steps

MODES = ("ddp", "zero1", "zero2", "zero3", "zero3-blocks")
Mode = Literal["ddp", "zero1", "zero2", "zero3", "zero3-blocks"]
VARIANTS = ("eager", "blocks", "model", "graph")
Variant = Literal["eager", "blocks", "model", "graph"]
GPU_VARIANTS = ("blocks", "model", "graph")  # compiled or recorded: GPU processes only


@dataclass
class FsdpStepConfig(Config):
    """Run under torchrun: DDP and the ZeRO stages on the same model and data, state and time."""

    model: str = opt("wrn-28-10", "the network, WRN-depth-width")
    batch: int = opt(128, "images per process")
    modes: tuple[Mode, ...] = opt(MODES, "the modes to compare, in these processes")
    variants: tuple[Variant, ...] = opt(("eager",), "how each mode runs: eager, blocks "
                                        "(compiled per block), model (compiled whole), graph "
                                        "(DDP: the step as one CUDA graph); GPU only but eager")
    steps: int = opt(3, "training steps whose losses are compared")
    repeats: int = opt(0, "timed steps (0: none)")
    units: Literal["model", "group", "block"] = opt("group", "the FSDP units besides the root")
    prefetch: bool = opt(False, "explicit FSDP prefetching")
    fit_gib: float | None = opt(None, "cap each process's GPU memory (GiB): can it train?")
    trace: Path | None = opt(None, "rank 0 writes DIR/<mode>-<variant>.json profiler traces")
    device: Literal["auto", "cpu", "cuda"] = opt("auto", "cuda needs one GPU per process")
    out: Path = opt(Path("runs/fsdp.jsonl"), "rank 0 appends one JSON line per mode here")

    def __post_init__(self) -> None:
        check_wrn(self.model)
        check((self.batch >= 1, f"--batch must be >= 1, got {self.batch}"),
              (bool(self.modes), "--modes needs at least one mode"),
              (bool(self.variants), "--variants needs at least one variant"),
              (self.steps >= 1 and self.repeats >= 0, "need --steps >= 1 and --repeats >= 0"),
              (self.fit_gib is None or self.fit_gib > 0, "--fit-gib must be > 0"),
              # an out-of-memory error can leave memory behind for the next mode
              (not self.fit_gib or len(self.modes) * len(self.variants) == 1,
               "--fit-gib takes one mode and one variant per job, so no failed attempt "
               "affects the next"))

    def runs(self) -> list[tuple[str, str]]:
        """The (mode, variant) pairs to measure: a step graph records DDP's step only."""
        return [(m, v) for m in self.modes for v in self.variants if v != "graph" or m == "ddp"]


def build(mode: str, variant: str, ctx: DistContext, args: FsdpStepConfig, graph: StepGraph):
    """The model and optimizer of one mode and variant, from the same initial weights."""
    torch.manual_seed(0)
    # FSDP2 gathers parameters into contiguous tensors, so no mode makes the weights
    # channels_last: cuDNN converts them per convolution, in every mode alike.
    net = wide_resnet(args.model).to(ctx.device)
    on_gpu = ctx.device.type == "cuda"
    whole = variant in ("model", "graph")
    if mode in ("ddp", "zero1"):
        if variant == "blocks":
            compile_blocks_of([net])
        ids = [ctx.device.index] if on_gpu else None
        with graph.stream():  # DDP is built on the stream that records the step
            # no second copy of the gradients; DDP even for a group of one (see the docstring)
            model = DistributedDataParallel(torch.compile(net, dynamic=False) if whole else net,
                                            device_ids=ids, gradient_as_bucket_view=True)
        if variant == "graph":  # a recorded optimizer step reads its lr from a tensor
            lr = torch.tensor(0.05, device=ctx.device)
            return model, torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9, fused=True)
        sgd = {"lr": 0.05, "momentum": 0.9, "fused": on_gpu or None}
        if mode == "zero1":
            return model, ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, **sgd)
        return model, torch.optim.SGD(net.parameters(), **sgd)
    model = shard(net, ctx, units="block" if mode == "zero3-blocks" else args.units,
                  reshard_after_forward=mode != "zero2", prefetch=args.prefetch,
                  compile_blocks=variant == "blocks")
    if whole:
        model = torch.compile(model, dynamic=False)
    # DTensor has no sharding rule for fused SGD's kernel (it has one for fused Adam):
    # the sharded parameters take the multi-tensor (foreach) kernels instead.
    sgd = {"lr": 0.05, "momentum": 0.9, "foreach": on_gpu or None}
    return model, torch.optim.SGD(model.parameters(), **sgd)


@dataclass
class FsdpRow:
    """Rank 0's row for one mode and variant: the state a rank holds, its first losses, the
    step's times and peak memory; or why it was skipped or did not fit."""

    mode: str
    variant: str
    world_size: int = 0
    device: str = ""
    model: str = ""
    per_gpu_batch: int = 0
    units: str = ""
    prefetch: bool = False
    fit_gib: float | None = None
    sgd: str | None = None  # the optimizer's kernels: fused, foreach or a loop
    losses: list[float] | None = None
    fits: bool | None = None  # under --fit-gib: whether the mode trained at all
    params: int | None = None  # bytes this rank holds
    grads: int | None = None
    optimizer: int | None = None
    step_ms: float | None = None
    step_spread: float | None = None
    host_ms: float | None = None
    images_per_s: float | None = None
    gpu_kernels_ms: float | None = None  # with --trace
    gpu_nccl_ms: float | None = None
    all_reduces: float | None = None
    broadcasts: float | None = None
    peak_gib: float | None = None
    skipped: str | None = None
    kind: str = "modes"  # how the benchmark ran it: "modes" (the comparison) or "fit" (capped)

    @property
    def state(self) -> int:
        """Bytes of model state this rank holds: parameters, gradients, optimizer."""
        return self.params + self.grads + self.optimizer


def measure(mode: str, variant: str, ctx: DistContext, args: FsdpStepConfig) -> dict:
    dev = ctx.device
    batches = fresh_batches(ctx, args.batch)
    record = {"mode": mode, "variant": variant}
    with StepGraph(dev, enabled=variant == "graph") as graph:  # released before the group
        model, optimizer = build(mode, variant, ctx, args, graph)
        # ZeroRedundancyOptimizer wraps a local SGD
        sgd = getattr(optimizer, "optim", optimizer).defaults
        record["sgd"] = next((k for k in ("fused", "foreach") if sgd[k]), "loop")
        x, y = (t.clone() for t in batches[0])  # the step reads its batch from these

        def body() -> torch.Tensor:
            _, loss = forward_loss(model, x, y, "bf16" if dev.type == "cuda" else "fp32")
            loss.backward()
            optimizer.step()
            return loss.detach()

        def eager() -> torch.Tensor:
            # Cleared first, so the gradients are still there for local_bytes after the last
            # step. (A recorded step must not clear them: its replays refill the same memory.)
            optimizer.zero_grad(set_to_none=True)
            return body()

        replay = graph.capture(body, model, optimizer) if graph.enabled else eager

        def step(i: int = 0) -> torch.Tensor:
            x.copy_(batches[i % 2][0])
            y.copy_(batches[i % 2][1])
            return replay()

        try:
            record["losses"] = [float(step(i)) for i in range(args.steps)]
        except torch.cuda.OutOfMemoryError:  # every rank runs the same shapes: all fail alike
            return record | {"fits": False}
        record |= {"fits": True, **local_bytes(model, optimizer)}
        if args.repeats:
            record |= time_steps(step, ctx, args.batch, args.repeats)
        if args.trace:  # every rank profiles (collectives must match), rank 0 writes
            args.trace.mkdir(parents=True, exist_ok=True)
            path = args.trace / f"{mode}-{variant}.json"
            record |= profile_steps(step, dev, path if ctx.is_main else None)
    if dev.type == "cuda":
        record["peak_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
    return record


def main(argv: list[str] | None = None) -> None:
    args = parse_or_exit(FsdpStepConfig, argv, __spec__.name)
    with distributed(args.device) as ctx, group_of_one(ctx):
        dev = ctx.device
        on_cpu = dev.type != "cuda"
        if args.fit_gib and not on_cpu:  # before the first allocation, for every mode
            total = torch.cuda.get_device_properties(dev).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, args.fit_gib * 2**30 / total))
        torch.backends.cudnn.benchmark = True
        # 1x1 convolutions' gradients come out channels_last, the same memory order: harmless
        warnings.filterwarnings("ignore", "Grad strides do not match bucket view strides")
        skipped = on_cpu and (args.fit_gib or any(v in GPU_VARIANTS for v in args.variants))
        records = [{"mode": m, "variant": v, "skipped": "needs CUDA GPUs"}
                   if on_cpu and (args.fit_gib or v in GPU_VARIANTS)
                   else measure(m, v, ctx, args) for m, v in args.runs()]
        if ctx.is_main:
            if skipped:
                print(f"skipped: --fit-gib and the variants {', '.join(GPU_VARIANTS)} need CUDA "
                      f"GPUs; this job has {dev}")
            common = {"world_size": ctx.world_size, "device": str(dev), "model": args.model,
                      "per_gpu_batch": args.batch, **{k: getattr(args, k) for k in
                                                      ("units", "prefetch", "fit_gib")}}
            write_jsonl(args.out, [dataclasses.asdict(FsdpRow(**common, **r)) for r in records])


if __name__ == "__main__":
    main()
