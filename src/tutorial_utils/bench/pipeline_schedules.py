"""Chapter 8's pipeline schedules on the GPT: the bubble against the number of micro-batches.

    python -m tutorial_utils.bench.pipeline_schedules --stages 2 4 --record   # GPUs: a record
    python -m tutorial_utils.bench.pipeline_schedules --device cpu            # CPU processes

For each number of pipeline processes p (``--stages``) it starts
:mod:`tutorial_utils.workers.gpt_pipeline` under torchrun, which times GPipe, 1F1B, interleaved
1F1B and ZB-V at each number of micro-batches m (a micro-batch keeps its size: the batch grows
with m), and counts the activations each process holds. Each row sets the measured bubble
(:func:`tutorial_utils.workers.gpt_pipeline.measured_bubble`: 1 - m x the slowest stage's
work per micro-batch / the step) beside the predicted one
(:func:`tutorial_utils.parallel.gpt_pipeline.bubble_fraction`).

On GPUs it is a record (``--record``, one GPU per process; float32 weights and activations,
matrix products in TF32, as the worker runs them there); a chapter without the record, or
on a machine without the GPUs, runs :func:`cpu_rows`: the same sweep, smaller, in CPU processes
(gloo), one compute thread each where the cores allow. There, a process that idles in a bubble
gives its core to another only if there are fewer cores than processes: the bubble is visible
as time only with a core per process.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Literal

from ..config import Config, check, check_gpus, opt, parse_or_exit
from ..devices import gpu_count
from ..launch import run_worker
from ..models.gpt import shape_rules
from ..parallel.gpt_pipeline import SCHEDULES, check_pipeline
from ..workers.gpt_pipeline import GPTPipelineConfig, GPTPipelineRow
from . import records
from .report import Column, table

RECORD = "08-pipeline-schedules"
WORKER = "tutorial_utils.workers.gpt_pipeline"
WHAT = ("Chapter 8: GPipe, 1F1B, interleaved 1F1B and ZB-V on the GPT, the step and its bubble "
        "against the number of micro-batches, on 2 and 4 GPUs")


@dataclass
class ScheduleRow:
    """One schedule on p processes at m micro-batches."""

    schedule: str
    ranks: int
    stages: int
    micro_batches: int
    step_ms: float
    work_ms: float  # the slowest process's forward + backward of one micro-batch, alone
    bubble_measured: float
    bubble_predicted: float
    in_flight: float  # the most micro-batches of activations a process held (measured)
    in_flight_predicted: float
    activation_mb: float  # the largest peak of saved activations on a process, MiB


def from_worker(r: GPTPipelineRow) -> ScheduleRow:
    return ScheduleRow(r.schedule, r.ranks, r.stages, r.micro_batches, r.step_ms,
                       max(r.work_ms), r.bubble_measured, r.bubble_predicted, max(r.in_flight),
                       max(r.in_flight_predicted), max(r.activation_mb))


@dataclass
class PipelineSchedulesConfig(Config):
    """The GPT's pipeline schedules: step time and bubble against the number of micro-batches."""

    stages: tuple[int, ...] = opt((2, 4), "pipeline processes (one GPU each), one sweep each")
    micro_batches: tuple[int, ...] = opt((4, 8, 16, 32), "numbers of micro-batches")
    schedules: tuple[str, ...] = opt(tuple(SCHEDULES), "the schedules")
    micro_batch: int = opt(2, "sequences per micro-batch")
    dim: int = opt(1024, "model width")
    heads: int = opt(16, "attention heads")
    layers: int = opt(16, "transformer blocks (>= 2 per process: interleaved and ZB-V)")
    seq: int = opt(512, "tokens per sequence (GPipe at m = 32 holds 32 micro-batches)")
    repeats: int = opt(10, "timed steps per row")
    device: Literal["auto", "cpu", "cuda"] = opt("auto", "cuda: one GPU per process")
    record: bool = opt(False, f"write the rows as the record {RECORD} (GPUs only)")

    def __post_init__(self) -> None:
        check(*shape_rules(self.dim, self.heads, self.layers, self.seq),
              (bool(self.stages) and min(self.stages) >= 2, "--stages: give numbers >= 2"),
              (self.repeats >= 1 and self.micro_batch >= 1,
               "--repeats and --micro-batch must be >= 1"),
              (not self.record or self.device != "cpu", "--record measures GPUs: leave out "
                                                        "--device cpu"))
        for schedule in self.schedules:
            for p in self.stages:
                for m in self.micro_batches:
                    check_pipeline(self.model_shape, p, schedule, m)

    @property
    def model_shape(self):
        from ..models.gpt import GPTConfig

        return GPTConfig(seq=self.seq, layers=self.layers, heads=self.heads, dim=self.dim)

    @property
    def on(self) -> str:
        if self.device != "auto":
            return self.device
        return "cuda" if gpu_count() >= max(self.stages) else "cpu"

    def check_machine(self) -> None:
        if self.on == "cuda" or self.record:
            check_gpus(max(self.stages), "--stages", "--device cpu (CPU processes)", fewest=2)


STAND_IN = "CPU processes (gloo)"
CPU_SIZE = {"dim": 64, "heads": 4, "layers": 8, "seq": 32, "micro_batch": 2,
            "micro_batches": (4, 8, 16), "repeats": 3}


def run(cfg: PipelineSchedulesConfig, timeout_s: float = 1200) -> list[ScheduleRow]:
    """Every schedule at every m, on each number of processes: the rows, in that order."""
    device = cfg.on
    rows = []
    for p in cfg.stages:
        threads = 0 if device == "cuda" else max(1, (os.cpu_count() or 1) // p)
        worker = GPTPipelineConfig(
            schedules=tuple(cfg.schedules), micro_batches=tuple(cfg.micro_batches),
            micro_batch=cfg.micro_batch, dim=cfg.dim, heads=cfg.heads, layers=cfg.layers,
            seq=cfg.seq, repeats=cfg.repeats, threads=threads, device=device)
        rows += [from_worker(r) for r in run_worker(WORKER, worker, nproc=p,
                                                    timeout_s=timeout_s,
                                                    row_type=GPTPipelineRow)]
    return rows


def cpu_stages(cfg: PipelineSchedulesConfig, cores: int | None = None) -> tuple[int, ...]:
    """The pipelines a CPU can time: a core per process, else a process idling in a bubble
    lends its core to another and the bubble does not show as time (2 at least)."""
    cores = cores or os.cpu_count() or 1
    return tuple(p for p in cfg.stages if p <= max(2, cores)) or (2,)


def cpu_config(cfg: PipelineSchedulesConfig) -> PipelineSchedulesConfig:
    """The sweep of ``cfg`` made small for CPU processes, on as many as there are cores."""
    return dataclasses.replace(cfg, device="cpu", stages=cpu_stages(cfg), **CPU_SIZE)


def cpu_rows(cfg: PipelineSchedulesConfig) -> list[ScheduleRow]:
    """The same sweep, small, in CPU processes (gloo)."""
    return run(cpu_config(cfg))


def measured_with(cfg: PipelineSchedulesConfig,
                  source: records.Source) -> PipelineSchedulesConfig:
    """The configuration the rows of :func:`measured` came from: the record's or this
    machine's GPUs' (``cfg``), or the small one of the CPU processes that stood in."""
    return cpu_config(cfg) if source.made.startswith(STAND_IN) else cfg


def check_rows(nproc: int, device: str = "cpu") -> list[GPTPipelineRow]:
    """Every schedule on ``nproc`` processes, its loss over two AdamW steps and its first
    gradients against one process's, and the activations each process held."""
    worker = GPTPipelineConfig(check=True, device=device)
    return run_worker(WORKER, worker, nproc=nproc, timeout_s=600, row_type=GPTPipelineRow)


def check_table(rows: list[GPTPipelineRow]) -> str:
    """Per schedule: the largest differences from one process, and the micro-batches of
    activations each process held at its peak, predicted and measured."""
    def per_rank(values: list[float]) -> str:
        return "  " + " ".join(f"{v:g}" for v in values)

    lines = [{"schedule": r.schedule, "ranks": r.ranks, "m": r.micro_batches,
              "loss_diff": r.loss_diff, "grad_diff": r.grad_diff,
              "predicted": per_rank(r.in_flight_predicted), "measured": per_rank(r.in_flight)}
             for r in rows]
    width = max(len(line["measured"]) for line in lines) + 2
    return table(lines, (
        Column("schedule", "schedule", width=18, left=True), Column("ranks", "p", width=3),
        Column("m", "m", width=3), Column("loss_diff", "loss diff", ".0e", 10),
        Column("grad_diff", "grad diff", ".0e", 10),
        Column("predicted", "  in flight, predicted", width=max(width, 23), left=True),
        Column("measured", "  measured", width=width, left=True)))


def measured(cfg: PipelineSchedulesConfig) -> tuple[list[ScheduleRow], records.Source]:
    """The record's rows; this machine's with TUTORIAL_MEASURE=1 and the GPUs; else CPU
    processes at a small size."""
    return records.measured(
        RECORD, lambda: run(dataclasses.replace(cfg, device="cuda")), gpus=max(cfg.stages),
        cfg=cfg, row_type=ScheduleRow, stand_in=lambda: cpu_rows(cfg),
        stand_in_where=STAND_IN,
        compare=records.Compare(("schedule", "ranks", "micro_batches"), "step_ms",
                                "schedule p m: step ms"))


COLUMNS = (Column("schedule", "schedule", width=18, left=True), Column("ranks", "p", width=3),
           Column("micro_batches", "m", width=4), Column("step_ms", "step ms", ".1f", 9),
           Column("work_ms", "work/mb ms", ".2f", 11),
           Column("bubble_predicted", "bubble pred.", ".2f", 13),
           Column("bubble_measured", "measured", ".2f", 9),
           Column("in_flight_predicted", "in flight pred.", ".1f", 16),
           Column("in_flight", "measured", ".1f", 9))


def rows_table(rows: list[ScheduleRow]) -> str:
    return table([dataclasses.asdict(r) for r in rows], COLUMNS)


def bubble_figure(rows: list[ScheduleRow], title: str):
    """The bubble against the number of micro-batches: each schedule's prediction (lines) and
    measurement (points), one panel per number of processes."""
    import matplotlib.pyplot as plt

    ranks = sorted({r.ranks for r in rows})
    fig, axes = plt.subplots(1, len(ranks), figsize=(5.2 * len(ranks), 3.8), squeeze=False,
                             sharey=True)
    for ax, p in zip(axes[0], ranks, strict=True):
        for i, schedule in enumerate(dict.fromkeys(r.schedule for r in rows)):
            mine = sorted((r for r in rows if r.ranks == p and r.schedule == schedule),
                          key=lambda r: r.micro_batches)
            if not mine:
                continue
            ms = [r.micro_batches for r in mine]
            color = f"C{i}"
            # GPipe's prediction is 1F1B's: dashed, so that the line beneath shows
            ax.plot(ms, [r.bubble_predicted for r in mine], "--" if schedule == "gpipe" else "-",
                    color=color, label=schedule)
            ax.plot(ms, [r.bubble_measured for r in mine], "o", color=color)
        ax.set(xlabel="micro-batches m", title=f"{p} processes")
        ax.set_xticks(ms, [str(m) for m in ms])
    axes[0][0].set_ylabel("bubble: idle fraction of the step")
    axes[0][0].legend(fontsize=8, title="line: predicted, dots: measured", title_fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> None:
    cfg = parse_or_exit(PipelineSchedulesConfig, argv, __spec__.name,
                        PipelineSchedulesConfig.check_machine)
    rows = run(cfg)
    print(rows_table(rows))
    if cfg.record:
        path = records.write(RECORD, cfg, rows, __spec__.name, [WORKER], gpus=max(cfg.stages),
                             what=WHAT)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
