"""Model parallelism measured in one run: single device, naive split, pipelined for each m.

    python -m tutorial_utils.bench.model_parallel --batch 2048 --micro-batches 1 2 4 8 16 32

Times forward + backward of one batch (bf16 autocast, channels_last, cuDNN autotuning; no
optimizer step) on one device, split across devices naively, and pipelined with m
micro-batches. The prediction for the pipeline is
:func:`~tutorial_utils.parallel.model_parallel.pipeline_ms` of the stages timed alone on one
micro-batch, t_s(b/m): for p equal stages the bubble model (m+p-1) t(b/m), with t(b/m)
measured, so it includes the fixed cost per micro-batch (launches, copies) that makes large m
stop paying. ``--schedules`` also times ``torch.distributed.pipelining`` with one stage per
process (:mod:`tutorial_utils.workers.pipeline_stage`), at ``--worker-micro-batches``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import statistics
import time
from dataclasses import dataclass

import torch
from torch import nn

from ..config import Config, ConfigError, check, check_gpus, check_wrn, opt, parse_or_exit
from ..devices import devices_for, gpu_count
from ..launch import run_worker
from ..models.wrn import wide_resnet
from ..parallel.model_parallel import (
    ModelParallel,
    PipelinedModelParallel,
    balanced_boundaries,
    bubble_fraction,
    forward_flops,
    pipeline_ms,
    split_sequential,
)
from ..step import forward_loss
from ..timing import benchmark, cudnn_autotuning
from ..workers.pipeline_stage import PipelineConfig, StageRow
from . import mfu, records
from .report import Column, legend_outside, table

RECORD = "03-model-parallel"
WHAT = ("Chapter 3: a WRN-28-10 training step on one GPU, split over two, and pipelined with m "
        "micro-batches")
PIPELINE_WORKER = "tutorial_utils.workers.pipeline_stage"


@dataclass
class ModelParallelConfig(Config):
    """Model parallelism measured in one run: one device, naive split, pipelined for each m."""

    model: str = opt("wrn-28-10", "the network, WRN-depth-width")
    batch: int = opt(2048, "images per step, a multiple of every m")
    micro_batches: tuple[int, ...] = opt((1, 2, 4, 8, 16, 32), "the pipeline's m, each timed")
    devices: int = opt(2, "stages, one per GPU, 2..8 (on a machine without GPUs, CPU stages)")
    repeats: int = opt(10, "timed steps of each run")
    schedules: bool = opt(False, "also time GPipe and 1F1B with one stage per process")
    worker_micro_batches: int = opt(8, "m of the one-stage-per-process pipelines")
    record: bool = opt(False, f"write the result as the record {RECORD} (book/data)")

    def __post_init__(self) -> None:
        check_wrn(self.model)
        ms = (*self.micro_batches, self.worker_micro_batches)
        check((self.batch >= 1, f"--batch must be >= 1, got {self.batch}"),
              (bool(self.micro_batches), "--micro-batches needs at least one m"),
              (all(1 <= m <= self.batch for m in ms),
               f"every m must be in 1..--batch ({self.batch}): a micro-batch holds at least "
               f"one image, got {ms}"),
              # the smallest WRN, wrn-10-1, has 9 layers: 8 stages always get one each
              (2 <= self.devices <= 8, f"--devices must be in 2..8 (a split needs two stages), "
               f"got {self.devices}"),
              (self.repeats >= 1, f"--repeats must be >= 1, got {self.repeats}"))
        if twice := next((m for m in self.micro_batches if self.micro_batches.count(m) > 1), None):
            raise ConfigError(f"--micro-batches lists {twice} twice; name each m once")
        # x.chunk(m) cuts a batch m does not divide into unequal (or fewer than m) micro-batches
        pairs = [("--micro-batches", m) for m in self.micro_batches]
        for flag, m in [*pairs, ("--worker-micro-batches", self.worker_micro_batches)]:
            if self.batch % m:
                every = math.lcm(*ms)
                fits = math.ceil(self.batch / every) * every
                raise ConfigError(f"--batch {self.batch} is not a multiple of {flag} {m}: the "
                                  f"micro-batches would differ in size; use --batch {fits}, a "
                                  "multiple of every m")

    def check_machine(self) -> None:
        """One GPU per stage; only a machine without GPUs runs the stages on its CPU."""
        if gpu_count():
            check_gpus(self.devices, "--devices", "CUDA_VISIBLE_DEVICES= to run the stages on "
                       "the CPU", fewest=2)


@dataclass
class PipelineRow:
    name: str
    micro_batches: int | None
    measured_ms: float
    predicted_ms: float | None = None

    def speedup_over(self, naive_ms: float) -> float:
        return naive_ms / self.measured_ms


def stage_times_ms(stages: nn.ModuleList, devices: list[torch.device], x: torch.Tensor,
                   repeats: int) -> list[float]:
    """Forward + backward of each stage alone on input ``x`` (its real activations)."""
    times, h = [], x
    for stage, dev in zip(stages, devices, strict=True):
        inp = h.detach().to(dev).requires_grad_(h is not x)
        times.append(benchmark(_stage_step(stage, inp), warmup=2, repeats=repeats,
                               device=dev).median_ms)
        with torch.no_grad(), _autocast(dev):
            h = stage(inp)
    return times


def _autocast(dev: torch.device):
    return torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")


def _stage_step(stage: nn.Module, inp: torch.Tensor):
    def step() -> None:  # a stage alone has no loss: the sum of its output stands for one
        with _autocast(inp.device):
            out = stage(inp)
        out.float().sum().backward()
        stage.zero_grad(set_to_none=True)
    return step


# cuDNN times its algorithms for each new shape (each micro-batch size) during the warm-up
# steps, as the torchrun stages of workers/pipeline_stage.py do: both pipelines run alike.
@cudnn_autotuning()
def run(cfg: ModelParallelConfig, cpu: bool = False) -> tuple[list[PipelineRow],
                                                              list[torch.device]]:
    """One device, the naive split and each pipeline of ``cfg``, timed in this process (on GPUs
    where there are enough, or with ``cpu`` every stage on the CPU)."""
    devices = [torch.device("cpu")] * cfg.devices if cpu else devices_for(cfg.devices)
    torch.manual_seed(0)
    base = wide_resnet(cfg.model).to(memory_format=torch.channels_last)
    x = torch.randn(cfg.batch, 3, 32, 32).to(devices[0], memory_format=torch.channels_last)
    y = torch.randint(0, 10, (cfg.batch,), device=devices[-1])  # where the logits come out
    # Stages of equal arithmetic, not equal parameter counts (see forward_flops).
    starts = balanced_boundaries(base, cfg.devices,
                                 forward_flops(base, torch.randn(2, 3, 32, 32)))
    one = copy.deepcopy(base).to(devices[0])
    rows = [PipelineRow("1 device", None, _timed(one, x, y.to(devices[0]), devices[:1],
                                                 cfg.repeats))]
    naive = ModelParallel(copy.deepcopy(base), devices, starts)
    rows.append(PipelineRow(f"naive split, {cfg.devices} devices", 1,
                            _timed(naive, x, y, devices, cfg.repeats)))
    stages = split_sequential(copy.deepcopy(base), devices, starts)
    for m in cfg.micro_batches:
        predicted = pipeline_ms(stage_times_ms(stages, devices, x[: cfg.batch // m],
                                               cfg.repeats), m)
        pipe = PipelinedModelParallel(copy.deepcopy(base), devices, micro_batches=m,
                                      starts=starts)
        rows.append(PipelineRow(f"pipelined, m={m}", m,
                                _timed(pipe, x, y, devices, cfg.repeats), predicted))
    return rows, devices


def _timed(model: nn.Module, x, y, devices, repeats: int) -> float:
    """Median ms of a step spanning several devices: CUDA events on one device would miss the
    work of the others (backward ends on the first), so wait for all of them around each."""
    def step() -> None:
        forward_loss(model, x, y, "bf16" if x.device.type == "cuda" else "fp32")[1].backward()
        model.zero_grad(set_to_none=True)

    def sync_all() -> None:
        for d in {d for d in devices if d.type == "cuda"}:
            torch.cuda.synchronize(d)

    for _ in range(2):
        step()
    samples = []
    for _ in range(repeats):
        sync_all()
        t0 = time.perf_counter()
        step()
        sync_all()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def pipeline_worker(cfg: PipelineConfig, nproc: int = 2) -> StageRow:
    """What :mod:`~tutorial_utils.workers.pipeline_stage` measured with ``cfg`` in ``nproc``
    processes."""
    return run_worker(PIPELINE_WORKER, cfg, nproc=nproc, row_type=StageRow)[0]


def schedule_times(cfg: ModelParallelConfig, device: str) -> dict[str, StageRow]:
    """GPipe and 1F1B with one stage per process, timed as the in-process pipeline is."""
    return {s: pipeline_worker(PipelineConfig(
        model=cfg.model, batch=cfg.batch, micro_batches=cfg.worker_micro_batches, schedule=s,
        device=device, repeats=cfg.repeats), nproc=cfg.devices) for s in ("gpipe", "1f1b")}


def rows_of(rows: list[PipelineRow], schedules: dict[str, StageRow]) -> list[dict]:
    """The measurements as plain rows, as a record stores them: each labelled by its kind."""
    return [dataclasses.asdict(r) | {"kind": "in_process"} for r in rows] + [
        dataclasses.asdict(rec) | {"kind": "schedule"} for rec in schedules.values()]


def from_rows(rows: list[dict]) -> tuple[list[PipelineRow], dict[str, StageRow]]:
    """What :func:`rows_of` stored, back as the benchmark's results."""
    def typed(kind: str, row_type: type) -> list:
        return [records.from_row(row_type, {k: v for k, v in r.items() if k != "kind"})
                for r in rows if r["kind"] == kind]

    return typed("in_process", PipelineRow), {s.schedule: s for s in typed("schedule", StageRow)}


def measured(cfg: ModelParallelConfig) -> tuple[list[PipelineRow], dict[str, StageRow],
                                                 records.Source]:
    """Chapter 3's timings on ``cfg.devices`` GPUs: the record's; this machine's with
    TUTORIAL_MEASURE=1; without a record, every stage on the CPU, at ``cfg``'s size."""
    def measure(cpu: bool):
        def rows() -> list[dict]:
            timed, _ = run(cfg, cpu)
            return rows_of(timed, schedule_times(cfg, "cpu" if cpu else "cuda")
                           if cfg.schedules else {})
        return rows

    rows, source = records.measured(
        RECORD, measure(False), gpus=cfg.devices, cfg=cfg, stand_in=measure(True),
        stand_in_where="this process",
        compare=records.Compare(("name",), "measured_ms", "run: ms"))
    return (*from_rows(rows), source)


COLUMNS = (Column("name", "run", width=26, left=True), Column("ms", "ms", ".2f", 9),
           mfu.COLUMN, Column("x", "vs naive", ".2f", 10, unit="x"),
           Column("pred", "predicted", ".2f", 11), Column("err", "error", "+.1%", 8),
           Column("bubble", "bubble", ".1%", 8))


def row_mfus(rows: list[PipelineRow], stages: int, model: str | None, batch: int | None,
             gpu: str | None) -> list[float | None]:
    """Each row's MFU: forward + backward of ``batch`` images of ``model`` over the peak of the
    GPUs it ran on (the first row one, the others ``stages``); None without a model or GPU."""
    if model is None or batch is None:
        return [None] * len(rows)
    flops = mfu.wrn_step_flops(model, batch)  # forward + backward: no optimizer is timed
    return [mfu.mfu(flops, r.measured_ms, gpu, 1 if i == 0 else stages)
            for i, r in enumerate(rows)]


def table_of(rows: list[PipelineRow], stages: int, model: str | None = None,
             batch: int | None = None, gpu: str | None = None) -> str:
    """One line per run; with ``model`` and ``batch``, each run's MFU on the GPUs named ``gpu``
    (the first row on one, the others on ``stages``) and a note that says what it divides by."""
    naive = rows[1].measured_ms
    shares = row_mfus(rows, stages, model, batch, gpu)
    lines = table([{"name": r.name, "ms": r.measured_ms, "x": r.speedup_over(naive),
                    "pred": r.predicted_ms, "mfu": share,
                    "err": r.measured_ms / r.predicted_ms - 1 if r.predicted_ms else None,
                    "bubble": bubble_fraction(stages, r.micro_batches) if r.micro_batches
                    else None} for r, share in zip(rows, shares, strict=True)], COLUMNS)
    if model is None or batch is None:
        return lines
    flops = mfu.gflop(mfu.wrn_step_flops(model, batch))
    return lines + "\n" + mfu.note(gpu, f"{model.upper()}, forward + backward of {batch} images: "
                                   f"{flops}; a run on N GPUs is set against N peaks")


def summary(rows: list[PipelineRow], model: str | None = None, batch: int | None = None,
            gpu: str | None = None, stages: int = 2) -> dict[str, float | int]:
    """Flat numbers for chapter 3's prose: the naive split, the best pipeline, the prediction;
    with ``model``, ``batch`` and ``gpu``, the MFU (%) of one device, the split and the best."""
    single, naive, piped = rows[0], rows[1], rows[2:]
    best = min(piped, key=lambda r: r.measured_ms)
    shares = dict(zip(map(id, rows), row_mfus(rows, stages, model, batch, gpu), strict=True))
    return {"single_mfu": mfu.percent(shares[id(single)]),
            "naive_mfu": mfu.percent(shares[id(naive)]), "best_mfu": mfu.percent(shares[id(best)]),
            "single_ms": single.measured_ms, "naive_ms": naive.measured_ms,
           "naive_vs_single": single.measured_ms / naive.measured_ms,
           "best_m": best.micro_batches, "best_ms": best.measured_ms,
           "best_vs_naive": naive.measured_ms / best.measured_ms,
           "best_vs_single": single.measured_ms / best.measured_ms,
           "best_pred_ms": best.predicted_ms,
           "best_err": abs(best.measured_ms / best.predicted_ms - 1) * 100,
           "worst_err": max(abs(r.measured_ms / r.predicted_ms - 1) for r in piped) * 100,
           "m1_vs_naive": naive.measured_ms / piped[0].measured_ms,
           "largest_m": piped[-1].micro_batches,
           "largest_m_vs_naive": naive.measured_ms / piped[-1].measured_ms}


def plot(rows: list[PipelineRow], stages: int, title: str):
    """Speed-up over the naive split against m: measured, predicted, and the bare bubble model."""
    import matplotlib.pyplot as plt

    naive = rows[1].measured_ms
    piped = [r for r in rows if r.predicted_ms]
    m = [r.micro_batches for r in piped]
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    # Equal stages and no cost per micro-batch: p t against (m+p-1) t/m.
    ax.plot(m, [stages * k / (k + stages - 1) for k in m], "k:", label="bubble model alone")
    ax.plot(m, [naive / r.predicted_ms for r in piped], "s--", color="#dd8452",
            label="predicted from stage times")
    ax.plot(m, [naive / r.measured_ms for r in piped], "o-", color="#4c72b0", label="measured")
    ax.axhline(naive / rows[0].measured_ms, color="grey", lw=1, label="one device")
    ax.set_xscale("log", base=2)
    ax.set_xticks(m, [str(k) for k in m])
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("speed-up over the naive split")
    ax.set_title(title, fontsize=9)
    legend_outside(ax)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> None:
    cfg = parse_or_exit(ModelParallelConfig, argv, __spec__.name,
                        ModelParallelConfig.check_machine)
    rows, devices = run(cfg)
    device = "cuda" if gpu_count() >= cfg.devices else "cpu"
    schedules = schedule_times(cfg, device) if cfg.schedules else {}
    print(f"{cfg.model.upper()}, batch {cfg.batch}, devices {[str(d) for d in devices]}")
    gpu = mfu.this_gpu() if devices[0].type == "cuda" else None
    print(table_of(rows, cfg.devices, cfg.model, cfg.batch, gpu))
    for name, rec in schedules.items():
        print(f"{name}: {rec.step_ms:.1f} ms per step, one stage per process ({device})")
    if cfg.record:
        path = records.write(RECORD, cfg, rows_of(rows, schedules), __spec__.name,
                             [PIPELINE_WORKER], gpus=cfg.devices, what=WHAT)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
