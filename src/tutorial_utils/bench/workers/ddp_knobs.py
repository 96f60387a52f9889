"""Run under torchrun: DDP's knobs, one setting at a time, on the same model and batches.

    torchrun --standalone --nproc_per_node=2 -m tutorial_utils.bench.workers.ddp_knobs \\
        --model wrn-28-10 --batch 128 --repeats 20 --out knobs.jsonl

Each setting wraps a fresh network (the same initial weights, the same batches) in
``DistributedDataParallel`` with one of its constructor's knobs changed: ``bucket_cap_mb`` over
``--buckets``; ``gradient_as_bucket_view``; ``static_graph``; ``broadcast_buffers=False``; the
three together. With ``--compiled``, three ways ``torch.compile`` meets DDP follow (chosen by
``torch._dynamo.config.optimize_ddp``): the forward cut into a graph per bucket, so that each
bucket's all-reduce can start during backward ("ddp_optimizer", the default); one graph, its
all-reduces after backward ("no_optimization"); and compiled autograd, which traces backward
too, with DDP's all-reduces inside it ("python_reducer"). On GPUs the graphs are compiled with
inductor; on CPU processes they are recorded and run as traced (the mechanics, not the speed).

One process forms a group of one, so that DDP wraps the model as it would on N GPUs. Rank 0
writes a JSON line per setting: the first losses, the median step time, the host's time to
queue a step, the peak memory, and from a profile of a few steps the all-reduces launched per
step, the communication time and the part of it with no compute beside it; for compiled
settings, the graphs compiled and the all-reduces inside them.
"""

from __future__ import annotations

import dataclasses
import inspect
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch.nn.parallel import DistributedDataParallel

from ...config import Config, check, check_wrn, opt, parse_or_exit
from ...jsonl import write_jsonl
from ...models.wrn import wide_resnet
from ...parallel.distributed import DistContext, distributed
from ...step import forward_loss
from .. import timeline
from .common import fresh_batches, group_of_one, time_steps

# torch.compile with DDP, by torch._dynamo.config.optimize_ddp (read when DDP is built and when
# dynamo compiles); compiled autograd last: DDP's python reducer changes inductor's settings.
COMPILED = {"compiled, a graph per bucket": "ddp_optimizer",
            "compiled, one graph": "no_optimization",
            "compiled autograd": "python_reducer"}


@dataclass
class KnobsRow:
    """Rank 0's row for one setting: what ran in a step, what it cost, or why it could not."""

    setting: str
    knobs: dict
    compiled: str | None  # how torch.compile meets DDP; None: not compiled
    world_size: int = 1
    device: str = ""
    model: str = ""
    per_gpu_batch: int = 0
    losses: list[float] | None = None  # the first steps' losses, compared across settings
    grad_tensors: int | None = None
    grad_mib: float | None = None
    grad_storages: int | None = None  # fewer than grad_tensors: views into DDP's buckets
    step_ms: float | None = None
    step_spread: float | None = None
    host_ms: float | None = None
    images_per_s: float | None = None
    all_reduces: float | None = None  # per step
    broadcasts: float | None = None
    comm_ms: float | None = None
    exposed_ms: float | None = None  # communication with no compute beside it
    graphs: int | None = None  # compiled settings: graphs, and all-reduces inside them
    all_reduces_in_graphs: int | None = None
    backend: str | None = None
    peak_gib: float | None = None
    failed: str | None = None  # a compiled setting this torch could not run: why


@dataclass
class KnobsStepConfig(Config):
    """Run under torchrun: DDP's knobs, one setting at a time, on the same model and batches."""

    model: str = opt("wrn-28-10", "the network, WRN-depth-width")
    batch: int = opt(128, "images per process")
    buckets: tuple[float, ...] = opt((1, 5, 25, 100, 200), "bucket_cap_mb values to sweep (MiB)")
    compiled: bool = opt(False, "also the three ways torch.compile meets DDP")
    steps: int = opt(3, "training steps whose losses are compared")
    repeats: int = opt(20, "timed steps (the median is reported)")
    device: Literal["auto", "cpu", "cuda"] = opt("auto", "cuda needs one GPU per process")
    out: Path = opt(Path("runs/ddp_knobs.jsonl"), "rank 0 appends one JSON line per setting")

    def __post_init__(self) -> None:
        check_wrn(self.model)
        check((self.batch >= 1, f"--batch must be >= 1, got {self.batch}"),
              (self.steps >= 1 and self.repeats >= 1, "need --steps >= 1 and --repeats >= 1"),
              (bool(self.buckets) and min(self.buckets) > 0,
               f"--buckets: sizes in MiB, each > 0, got {self.buckets}"),
              (len(set(self.buckets)) == len(self.buckets),
               f"--buckets names a size twice: {self.buckets}"))


@dataclass(frozen=True)
class Setting:
    name: str
    knobs: dict  # DistributedDataParallel's keyword arguments
    compiled: str | None = None  # optimize_ddp's mode; None: eager


def settings(cfg: KnobsStepConfig) -> list[Setting]:
    """The settings to measure: DDP's defaults, each knob alone, the three flags together.

    Left unset, ``bucket_cap_mb`` is 25 MiB with a first bucket (the last layers' gradients,
    ready first) of 1 MiB; set to any value, every bucket gets that value. The compiled settings
    set it, since compiled autograd hands it to inductor, which buckets the all-reduces itself.
    """
    three = {"gradient_as_bucket_view": True, "static_graph": True, "broadcast_buffers": False}
    out = [Setting("defaults", {})]
    out += [Setting(f"bucket_cap_mb={mb:g}", {"bucket_cap_mb": mb}) for mb in cfg.buckets]
    out += [Setting(k if v is True else f"{k}={v}", {k: v}) for k, v in three.items()]
    out.append(Setting("all three", three))
    if cfg.compiled:
        out += [Setting(name, {"bucket_cap_mb": 25}, mode) for name, mode in COMPILED.items()]
    return out


def ddp_kwargs(knobs: dict) -> dict:
    """``knobs`` for this torch: from 2.13 on, ``broadcast_buffers`` is ``forward_sync_buffers``
    (the buffers, such as BatchNorm's running statistics, sent from rank 0 at every forward)."""
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters:
        knobs = {("forward_sync_buffers" if k == "broadcast_buffers" else k): v
                 for k, v in knobs.items()}
    return knobs


class GraphLog:
    """A torch.compile backend that notes each graph it is given and the all-reduces inside it,
    then compiles it with inductor (GPUs) or runs it as traced (CPU processes)."""

    def __init__(self, inductor: bool) -> None:
        self.inductor, self.all_reduces = inductor, []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        ops = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
        if ops:  # dynamo also hands over empty graphs (a frame with nothing to compute)
            self.all_reduces.append(sum("all_reduce" in op for op in ops))
        if self.inductor:
            return torch._dynamo.lookup_backend("inductor")(gm, example_inputs)
        return gm.forward


def build(setting: Setting, cfg: KnobsStepConfig, ctx: DistContext, log: GraphLog):
    """DDP with ``setting``'s knobs around a fresh network, and a function that runs forward and
    backward on a batch (compiled as ``setting`` says)."""
    torch.manual_seed(0)
    net = wide_resnet(cfg.model).to(ctx.device, memory_format=torch.channels_last)
    ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    inner = (torch.compile(net, backend=log, dynamic=False)  # compiled inside DDP's forward,
             if setting.compiled in ("ddp_optimizer", "no_optimization") else net)  # as ch. 4
    model = DistributedDataParallel(inner, device_ids=ids, **ddp_kwargs(setting.knobs))
    precision = "bf16" if ctx.device.type == "cuda" else "fp32"

    def forward_backward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = forward_loss(model, x, y, precision)[1]
        loss.backward()
        return loss.detach()

    if setting.compiled == "python_reducer":  # backward is traced when it runs inside a
        return model, torch.compile(forward_backward, backend=log, dynamic=False)  # compiled fn
    return model, forward_backward


def measure(setting: Setting, cfg: KnobsStepConfig, ctx: DistContext) -> dict:
    """Losses, step time, memory and all-reduces of one setting."""
    dev = ctx.device
    batches = fresh_batches(ctx, cfg.batch)
    log = GraphLog(inductor=dev.type == "cuda")
    with torch._dynamo.config.patch(optimize_ddp=setting.compiled or "ddp_optimizer",
                                    compiled_autograd=setting.compiled == "python_reducer"):
        model, forward_backward = build(setting, cfg, ctx, log)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9,
                                    fused=dev.type == "cuda" or None)
        x, y = (t.clone() for t in batches[0])

        def step(i: int = 0) -> torch.Tensor:
            x.copy_(batches[i % 2][0])
            y.copy_(batches[i % 2][1])
            optimizer.zero_grad(set_to_none=True)
            loss = forward_backward(x, y)
            optimizer.step()
            return loss

        record = {"setting": setting.name, "knobs": setting.knobs, "compiled": setting.compiled,
                  "losses": [float(step(i)) for i in range(cfg.steps)]}
        # where the gradients live: one tensor each, or views into DDP's buckets
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        record |= {"grad_tensors": len(grads), "grad_mib": sum(g.nbytes for g in grads) / 2**20,
                   "grad_storages": len({g.untyped_storage().data_ptr() for g in grads})}
        record |= time_steps(step, ctx, cfg.batch, cfg.repeats) | profiled(step, ctx)
    if setting.compiled:
        record |= {"graphs": len(log.all_reduces), "all_reduces_in_graphs": sum(log.all_reduces),
                   "backend": "inductor" if log.inductor else "traced, run eagerly"}
    if dev.type == "cuda":
        record["peak_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
    return record


def attempt(setting: Setting, cfg: KnobsStepConfig, ctx: DistContext) -> dict:
    """:func:`measure`; a compiled setting that this torch cannot run is reported, not fatal
    (every rank compiles the same graphs, so every rank fails alike, before any collective)."""
    if not setting.compiled:
        return measure(setting, cfg, ctx)
    try:
        return measure(setting, cfg, ctx)
    except Exception as err:  # compiled autograd and the python reducer are experimental
        first = (str(err).strip().splitlines() or [""])[0][:160]
        return {"setting": setting.name, "knobs": setting.knobs, "compiled": setting.compiled,
                "failed": f"{type(err).__name__}: {first}"}


def profiled(step, ctx: DistContext) -> dict:
    """All-reduces and broadcasts per step, and communication with and without compute beside
    it (rank 0's view; every rank profiles, so that their collectives match)."""
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        counts = timeline.profile_steps(step, ctx.device, trace)
        shares = timeline.overlap(timeline.load(trace))
    return {"all_reduces": counts["all_reduces"], "broadcasts": counts["broadcasts"],
            "comm_ms": shares["comm_ms"], "exposed_ms": shares["exposed_ms"]}


def main(argv: list[str] | None = None) -> None:
    cfg = parse_or_exit(KnobsStepConfig, argv, __spec__.name)
    with distributed(cfg.device) as ctx, group_of_one(ctx):
        torch.backends.cudnn.benchmark = True
        # 1x1 convolutions' gradients come out channels_last, the same memory order: harmless
        warnings.filterwarnings("ignore", "Grad strides do not match bucket view strides")
        records = [attempt(s, cfg, ctx) for s in settings(cfg)]
        if ctx.is_main:
            common = {"world_size": ctx.world_size, "device": str(ctx.device),
                      "model": cfg.model, "per_gpu_batch": cfg.batch}
            write_jsonl(cfg.out, [dataclasses.asdict(KnobsRow(**r, **common)) for r in records])


if __name__ == "__main__":
    main()
