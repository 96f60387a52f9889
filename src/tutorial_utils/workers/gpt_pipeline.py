"""Run under torchrun: the GPT in pipeline stages, one process per stage (or two, interleaved).

    torchrun --standalone --nproc_per_node=4 -m tutorial_utils.workers.gpt_pipeline \\
        --schedules gpipe 1f1b interleaved-1f1b zbv --micro-batches 4 8 --check --out p.jsonl

For each schedule and each number of micro-batches m, every process builds only its own stages
(:mod:`tutorial_utils.parallel.gpt_pipeline`) and

- with ``--check``: trains ``--steps`` steps (AdamW) and compares the loss of each step and the
  gradients of the first with those of the whole GPT trained in one process on the same batches;
- counts the activations it holds at its peak (micro-batches in flight, and bytes) against the
  schedule's prediction;
- with ``--repeats``: times the step, and the work of one micro-batch through its stages alone
  (no communication, no waiting), which gives the measured bubble (:func:`measured_bubble`).

Rank 0 writes one :class:`GPTPipelineRow` per (schedule, m).
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist

from ..config import Config, check, opt, parse_or_exit
from ..jsonl import write_jsonl
from ..models.gpt import GPTConfig, lm_loss, shape_rules
from ..parallel.distributed import DistContext, distributed
from ..parallel.gpt_pipeline import (
    MULTI,
    SCHEDULES,
    ActivationMeter,
    bubble_fraction,
    build_pipeline,
    check_pipeline,
    in_flight,
    reference_gpt,
    schedule_peak,
    stage_parameter_names,
    stages_per_rank,
)
from ..timing import benchmark

Schedule = Literal["gpipe", "1f1b", "interleaved-1f1b", "zbv"]


@dataclass
class GPTPipelineRow:
    """One schedule at one number of micro-batches: equality, memory, time."""

    schedule: str
    ranks: int  # processes in the pipeline
    stages: int  # stages in all (ranks x stages per process)
    micro_batches: int
    micro_batch: int  # sequences per micro-batch
    seq: int
    params_per_rank: list[int]
    in_flight: list[float]  # measured per process: micro-batches of its layers held at the peak
    in_flight_predicted: list[float]  # gpt_pipeline.in_flight
    in_flight_plan: list[float] | None  # from torch's own list of actions (multi-stage only)
    activation_mb: list[float]  # measured peak of the saved activations per process, MiB
    bubble_predicted: float
    loss_diff: float | None = None  # with --check: largest |loss - one process's| over steps
    grad_diff: float | None = None  # largest |gradient - one process's| after the first step
    max_grad: float | None = None  # the largest gradient, for scale
    losses: list[float] | None = None
    step_ms: float | None = None  # with --repeats: the slowest process's median step
    work_ms: list[float] | None = None  # per process: one micro-batch through its stages, alone
    bubble_measured: float | None = None  # measured_bubble(step_ms, work_ms, micro_batches)


def measured_bubble(step_ms: float, work_ms: list[float], micro_batches: int) -> float:
    """The idle fraction of a step, from its time and the time of the stages' work.

    Each process times one micro-batch's forward and backward through its own stages alone,
    with nothing sent and nothing waited for (``work_ms``, ms per micro-batch). The slowest
    stage sets the pipeline's pace, so a step of m micro-batches holds at least m x max(work)
    of work on that process; whatever the step takes beyond it was spent waiting: the fill
    and drain of the pipeline, and the sends and receives between stages. So

        bubble = 1 - m x max(work_ms) / step_ms.

    With equal stages and free communication this is exactly the fraction the schedules'
    papers predict ((p-1)/(m+p-1) for GPipe: the step is (m+p-1) x work). The faster stages
    also idle by the difference from the slowest: that imbalance is left out here (it is not
    the schedule's doing), and so is any speed-up a stage gets in the pipeline from running
    its micro-batches back to back.
    """
    return 1 - micro_batches * max(work_ms) / step_ms


@dataclass
class GPTPipelineConfig(Config):
    """Run under torchrun: the GPT's pipeline schedules, checked against one process and timed."""

    schedules: tuple[Schedule, ...] = opt(("gpipe", "1f1b", "interleaved-1f1b", "zbv"),
                                          "the schedules to run")
    micro_batches: tuple[int, ...] = opt((4,), "numbers of micro-batches, one row each")
    micro_batch: int = opt(2, "sequences per micro-batch (the batch grows with m)")
    dim: int = opt(32, "the model width")
    heads: int = opt(2, "attention heads")
    layers: int = opt(8, "transformer blocks (at least the stages: 2 per process interleaved)")
    seq: int = opt(16, "tokens per sequence")
    check: bool = opt(False, "compare the loss and gradients with one process's")
    steps: int = opt(2, "training steps compared with --check (>= 2: activations are counted in "
                     "the last; the first also infers the stages' shapes)")
    repeats: int = opt(0, "timed steps (0: no timing)")
    threads: int = opt(0, "compute threads per process (0: torch's default)")
    device: Literal["auto", "cpu", "cuda"] = opt("auto", "cuda needs one GPU per process")
    out: Path = opt(Path("runs/gpt_pipeline.jsonl"), "rank 0 writes its rows here")

    def __post_init__(self) -> None:
        check(*shape_rules(self.dim, self.heads, self.layers, self.seq),
              (bool(self.schedules), "--schedules: name at least one"),
              (bool(self.micro_batches) and min(self.micro_batches) >= 1,
               "--micro-batches: give numbers >= 1"),
              (self.micro_batch >= 1, f"--micro-batch must be >= 1, got {self.micro_batch}"),
              (self.steps >= 2, f"--steps must be >= 2, got {self.steps}"),
              (self.repeats >= 0 and self.threads >= 0, "--repeats and --threads must be >= 0"))

    @property
    def model(self) -> GPTConfig:
        return GPTConfig(seq=self.seq, layers=self.layers, heads=self.heads, dim=self.dim)


def _fits(cfg: GPTPipelineConfig) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    check((world >= 2, "run it under torchrun with 2 or more processes"))
    for schedule in cfg.schedules:
        for m in cfg.micro_batches:
            check_pipeline(cfg.model, world, schedule, m)


def all_max(ctx: DistContext, values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def per_rank(ctx: DistContext, value: float) -> list[float]:
    """Every process's ``value``, in rank order (one all-reduce of a vector)."""
    t = torch.zeros(ctx.world_size, dtype=torch.float64, device=ctx.device)
    t[ctx.rank] = value
    dist.all_reduce(t)
    return t.tolist()


def batches(cfg: GPTPipelineConfig, m: int, steps: int, device: torch.device):
    """The same ``steps`` batches of m x micro_batch sequences on every process."""
    g = torch.Generator().manual_seed(1)
    size = (m * cfg.micro_batch, cfg.seq)
    return [(torch.randint(0, 256, size, generator=g).to(device),
             torch.randint(0, 256, size, generator=g).to(device)) for _ in range(steps)]


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)


def reference_run(cfg: GPTPipelineConfig, data, device) -> tuple[list[float], dict]:
    """One process, the whole GPT: the loss of each step, and the gradients of the first."""
    model = reference_gpt(cfg.model, device)
    opt = adamw(model.parameters())
    losses, grads = [], {}
    for i, (x, y) in enumerate(data):
        loss = lm_loss(model(x), y)
        loss.backward()
        if i == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, grads


def the_loss(ctx: DistContext, pipe, losses: list[torch.Tensor]) -> float:
    """The batch's loss (the mean over micro-batches), from the process with the last stage."""
    mine = torch.stack(losses).mean().item() if pipe.has_last else 0.0
    return sum(per_rank(ctx, mine))


def stage_work_ms(pipe, cfg: GPTPipelineConfig, device: torch.device, repeats: int) -> float:
    """One micro-batch's forward and backward through this process's stages, alone: each stage
    gets an input of the shape it receives and a gradient of the shape it sends back."""
    mb, seq, dim = cfg.micro_batch, cfg.seq, cfg.dim
    tokens = torch.randint(0, 256, (mb, seq), device=device)
    hidden = torch.randn(mb, seq, dim, device=device, requires_grad=True)
    grad_out = torch.randn(mb, seq, dim, device=device)

    def work() -> None:
        for stage, module in zip(pipe.stages, pipe.modules, strict=True):
            out = module(tokens if stage.is_first else hidden)
            if stage.is_last:
                lm_loss(out, tokens).backward()
            else:
                out.backward(grad_out)
        pipe.zero_grad()

    return benchmark(work, warmup=2, repeats=repeats, device=device).median_ms


def run(cfg: GPTPipelineConfig, ctx: DistContext, schedule: str, m: int) -> GPTPipelineRow:
    p = ctx.world_size
    model_cfg = cfg.model
    data = batches(cfg, m, cfg.steps, ctx.device)
    pipe = build_pipeline(model_cfg, schedule, ctx.rank, p, m, ctx.device)
    meter = ActivationMeter(pipe.modules)
    opt = adamw(list(pipe.parameters()))
    losses, grad_diff, max_grad = [], None, None
    for i, (x, y) in enumerate(data[: cfg.steps if cfg.check else 2]):
        meter.reset()  # the peak of the last step: the first also infers the stages' shapes
        with meter.active():  # around the pipeline's step only: not the one-process reference
            out = pipe.step(x, y)
        losses.append(the_loss(ctx, pipe, out))
        if i == 0 and cfg.check:
            grad_diff, max_grad = _grad_check(ctx, cfg, pipe, p, data)
        opt.step()
    meter.close()
    v = stages_per_rank(schedule)
    plan = None
    if schedule in MULTI:  # torch's own list of actions for this process, counted
        plan = per_rank(ctx, schedule_peak(pipe.schedule.pipeline_order[ctx.rank]) / v)
    row = GPTPipelineRow(
        schedule, p, p * v, m, cfg.micro_batch, cfg.seq,
        [int(n) for n in per_rank(ctx, sum(q.numel() for q in pipe.parameters()))],
        per_rank(ctx, meter.peak_chunks / v),
        [in_flight(schedule, r, p, m) for r in range(p)], plan,
        per_rank(ctx, meter.peak_bytes / 2**20), bubble_fraction(schedule, p, m))
    if cfg.check:
        reference, _ = reference_run(cfg, data, ctx.device)
        row.loss_diff = max(abs(a - b) for a, b in zip(losses, reference, strict=True))
        row.grad_diff, row.max_grad, row.losses = grad_diff, max_grad, losses
    if cfg.repeats:
        x, y = data[0]
        step = benchmark(lambda: pipe.step(x, y), warmup=2, repeats=cfg.repeats,
                         device=ctx.device).median_ms
        row.step_ms = max(per_rank(ctx, step))
        row.work_ms = per_rank(ctx, stage_work_ms(pipe, cfg, ctx.device, cfg.repeats))
        row.bubble_measured = measured_bubble(row.step_ms, row.work_ms, m)
    return row


def _grad_check(ctx, cfg, pipe, p, data) -> tuple[float, float]:
    """Largest difference between this pipeline's first-step gradients and one process's."""
    _, reference = reference_run(cfg, data[:1], ctx.device)
    n_stages = len(pipe.stages) * p
    diff = scale = 0.0
    for index, module in zip(pipe.indices, pipe.modules, strict=True):
        names = stage_parameter_names(cfg.model, index, n_stages)
        for name, q in zip(names, module.parameters(), strict=True):
            ref = reference[name]
            diff = max(diff, float((q.grad - ref).abs().max()))
            scale = max(scale, float(ref.abs().max()))
    diff, scale = all_max(ctx, [diff, scale])
    return diff, scale


def main(argv: list[str] | None = None) -> None:
    cfg = parse_or_exit(GPTPipelineConfig, argv, __spec__.name, machine=_fits)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    with distributed(cfg.device) as ctx:
        if ctx.device.type == "cuda":  # float32 throughout; TF32 for the matrix products
            torch.set_float32_matmul_precision("high")
        rows = []
        for schedule in cfg.schedules:
            for m in cfg.micro_batches:
                t0 = time.perf_counter()
                rows.append(run(cfg, ctx, schedule, m))
                if ctx.is_main:
                    print(f"{schedule} m={m}: {time.perf_counter() - t0:.1f} s", flush=True)
        if ctx.is_main:
            write_jsonl(cfg.out, [dataclasses.asdict(r) for r in rows])


assert set(SCHEDULES) == set(Schedule.__args__)  # the command line offers every schedule

if __name__ == "__main__":
    main()
