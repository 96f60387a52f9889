"""The scaling benchmark of chapter 5b: a Wide-ResNet on one GPU and on N with DDP.

    python -m tutorial_utils.bench.scaling --gpus 2 4

Strong scaling keeps the global batch (the Torch7 post split its 128 across the GPUs); weak
scaling keeps the per-GPU batch. Each regime runs eager, with CUDA graphs of the network
(``torch.compile(mode="reduce-overhead")``) and as a "step graph" (the whole step, all-reduces
and fused SGD included, as one CUDA graph: :class:`~tutorial_utils.step_graph.StepGraph`), with
DataParallel for comparison. Every speed-up is against the best single-GPU run of the same
invocation at the same global (strong) or per-GPU (weak) batch. The prediction is chapter 4's
model: the DDP step inside ``no_sync`` plus a ring all-reduce at the bus bandwidth measured in
the same run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch

from ..config import Config, ConfigError, check, check_gpus, opt, parse_or_exit
from ..devices import gpu_count, require_gpus
from ..parallel.collectives import ring_all_reduce_seconds
from . import mfu, records
from .ddp_timing import STEP_TIMING, ddp_step, time_ddp
from .report import Column, legend_outside, table
from .workload import LADDER, Workload, measure_rung, time_data_parallel

TRACE = "05b-trace"
RECORD = "05b-scaling"
WHAT = "Chapter 5b: one DDP training step, strong and weak scaling, one GPU against two"
TRAIN_IMAGES = 50_000
MODES = {"eager": LADDER[3], "CUDA graphs": LADDER[-1]}
STEP_GRAPH = "step graph"  # measured by workers.step_timing in 1 or N processes alike
GPU_ONLY_MODES = ("CUDA graphs", STEP_GRAPH)
Mode = Literal["eager", "CUDA graphs", "step graph"]


@dataclass
class ScalingConfig(Config):
    """The scaling benchmark of chapter 5b: a Wide-ResNet on one GPU and on N with DDP."""

    model: str = opt("wrn-28-10", "the network, WRN-depth-width")
    warmup: int = opt(5, "untimed steps before each timing")
    repeats: int = opt(20, "timed steps of each run; the median is reported")
    gpus: tuple[int, ...] = opt((2,), "GPU counts to scale to, e.g. 2 4 8")
    global_batch: int = opt(128, "the global batch of strong scaling")
    per_gpu_batch: int = opt(128, "the per-GPU batch of weak scaling")
    modes: tuple[Mode, ...] = opt(("eager", "CUDA graphs", "step graph"), "how each step runs")
    data_parallel: bool = opt(True, "also time nn.DataParallel (GPUs only)")
    device: Literal["auto", "cpu", "cuda"] = opt(
        "auto", "cuda, or cpu for CPU processes in place of GPUs (auto: cuda if there is one)")
    trace: bool = opt(False, f"instead, profile one DDP step on two GPUs (strong scaling, a "
                      f"step graph): the record {TRACE}")
    record: bool = opt(False, f"write the result as the record {RECORD} (book/data)")

    def __post_init__(self) -> None:
        Workload(self.model, 1, self.warmup, self.repeats)  # the same rules as every step
        check((bool(self.gpus) and min(self.gpus) >= 2,
               f"--gpus: scaling needs 2 or more GPUs per run, got {self.gpus}"),
              (bool(self.modes), "--modes needs at least one mode"),
              (min(self.global_batch, self.per_gpu_batch) >= 1,
               f"the batches must be >= 1, got --global-batch {self.global_batch} "
               f"--per-gpu-batch {self.per_gpu_batch}"))
        for flag, values in (("--gpus", self.gpus), ("--modes", self.modes)):
            if twice := next((v for v in values if values.count(v) > 1), None):
                raise ConfigError(f"{flag} lists {twice} twice; name each once")
        if bad := [n for n in self.gpus if self.global_batch % n]:
            raise ConfigError(f"--global-batch {self.global_batch} is not divisible by {bad[0]} "
                              f"GPUs; use a multiple of {bad[0]}")

    @property
    def on(self) -> str:
        """Where the runs go: cuda, or cpu for CPU processes in place of GPUs."""
        if self.device != "auto":
            return self.device
        return "cuda" if gpu_count() else "cpu"

    def check_machine(self) -> None:
        """On cuda, every GPU count needs that many GPUs; --device cpu needs none."""
        if self.on == "cuda":
            check_gpus(max(self.gpus), "--gpus", "--device cpu (CPU processes)", fewest=2)


@dataclass
class Run:
    regime: str  # "single", "strong" or "weak"
    method: str  # "1 GPU", "DDP" or "DataParallel"
    mode: str  # "eager", "CUDA graphs" or "step graph"
    gpus: int
    per_gpu_batch: int
    step_ms: float
    predicted_ms: float | None = None  # DDP: compute + all-reduce, no overlap (chapter 4)
    speedup: float | None = None  # over the best single-GPU run of the same regime
    predicted: float | None = None  # the speed-up predicted_ms would give

    @property
    def images_per_s(self) -> float:
        return self.per_gpu_batch * self.gpus / self.step_ms * 1e3

    @property
    def epoch_s(self) -> float:
        return TRAIN_IMAGES / self.images_per_s


def single(cfg: ScalingConfig, batch: int, mode: str, device: str) -> Run:
    size = Workload(cfg.model, batch, cfg.warmup, cfg.repeats)
    if mode == STEP_GRAPH:
        rec = time_ddp(ddp_step(size, device, "default", capture=True), 1)
        return Run("single", "1 GPU", mode, 1, batch, rec.ddp_ms)
    dev = torch.device("cuda:0" if device == "cuda" else "cpu")
    # A fresh compilation per batch size: otherwise the second size recompiles the network
    # with a symbolic batch dimension, which is slower than either specialised graph.
    torch.compiler.reset()
    result = measure_rung(MODES[mode], size, dev)
    if result.ms is None:
        raise RuntimeError(f"{mode} cannot run here: {result.skipped}")
    return Run("single", "1 GPU", mode, 1, batch, result.ms)


def ddp_run(cfg: ScalingConfig, per_gpu: int, n: int, mode: str, regime: str,
            device: str) -> Run:
    size = Workload(cfg.model, per_gpu, cfg.warmup, cfg.repeats)
    if mode == STEP_GRAPH:
        rec = time_ddp(ddp_step(size, device, "default", capture=True), n)
    else:  # the same step as the single GPU's
        rec = time_ddp(ddp_step(size, device, MODES[mode].compile_mode or "none"), n)
    ring_ms = ring_all_reduce_seconds(rec.grad_bytes, n, rec.bus_gbps) * 1e3
    return Run(regime, "DDP", mode, n, per_gpu, rec.ddp_ms, predicted_ms=rec.no_sync_ms + ring_ms)


def run(cfg: ScalingConfig) -> list[Run]:
    """Every run of the benchmark for each GPU count of ``cfg``, with its speed-ups.

    ``cfg.device`` "cpu" makes the "GPUs" CPU processes (the default without GPUs), where the
    GPU-only modes are left out; on "cuda", asking for more GPUs than there are is an error
    rather than a silent run on the CPU.
    """
    device = cfg.on
    modes = [m for m in cfg.modes if device == "cuda" or m not in GPU_ONLY_MODES] or ["eager"]
    if device == "cuda":
        require_gpus(max(cfg.gpus))
    g, b = cfg.global_batch, cfg.per_gpu_batch
    # The single-GPU references, plus the per-GPU batch of strong scaling on two GPUs.
    runs = [single(cfg, batch, m, device) for batch in sorted({g, b, g // 2}) for m in modes]
    for n in cfg.gpus:
        for regime, per_gpu in (("strong", g // n), ("weak", b)):
            runs += [ddp_run(cfg, per_gpu, n, mode, regime, device) for mode in modes]
            if cfg.data_parallel and device == "cuda":
                ms = time_data_parallel(Workload(cfg.model, per_gpu, cfg.warmup, cfg.repeats), n,
                                        cudnn_benchmark=False)
                runs.append(Run(regime, "DataParallel", "eager", n, per_gpu, ms))
    for r in (r for r in runs if r.regime != "single"):
        reference = g if r.regime == "strong" else b
        best = min(s.step_ms for s in runs if s.regime == "single" and s.per_gpu_batch == reference)
        best_rate = reference / best  # images per ms of the best single-GPU run
        images = r.per_gpu_batch * r.gpus
        r.speedup = images / r.step_ms / best_rate
        if r.predicted_ms:
            r.predicted = images / r.predicted_ms / best_rate
    return runs


def measured(cfg: ScalingConfig) -> tuple[list[Run], records.Source]:
    """Chapter 5b's runs on ``max(cfg.gpus)`` GPUs: the record's; this machine's with
    TUTORIAL_MEASURE=1; without a record, in CPU processes at ``cfg``'s size."""
    return records.measured(
        RECORD, lambda: run(dataclasses.replace(cfg, device="cuda")), gpus=max(cfg.gpus),
        cfg=cfg, row_type=Run, stand_in=lambda: run(dataclasses.replace(cfg, device="cpu")),
        compare=records.Compare(("regime", "method", "mode", "gpus", "per_gpu_batch"),
                                "step_ms", "regime method mode GPUs batch: step ms"))


@dataclass
class TraceRow:
    """One DDP configuration profiled on rank 0 of two devices: what chapter 5b's timeline
    draws (the spans of each host thread and GPU stream), and the step's times."""

    model: str
    batch: int  # per device
    graphed: bool  # recorded as one CUDA graph per step (GPUs), else eager
    where: str
    ddp_ms: float
    no_sync_ms: float
    host_ms: float | None
    rows: dict[str, list[list]]  # row label -> [start us, duration us, category]
    starts: list[float]  # each profiled step's start on the host (us)
    shares: dict  # timeline.overlap: communication, compute and the two at once, per step


def measure_trace(step: Workload, device: str) -> TraceRow:
    """Profile the DDP step of ``step`` in two processes on ``device`` (a step graph on GPUs)."""
    import tempfile
    from pathlib import Path

    from . import timeline
    from .ddp_timing import trace

    graphed = device == "cuda"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        rec = trace(step, 2, device, graphed, path)
        events = timeline.load(path)
    return TraceRow(step.model, step.batch, graphed,
                    "two GPUs (NCCL)" if graphed else "two CPU processes (gloo)", rec.ddp_ms,
                    rec.no_sync_ms, rec.host_ms,
                    {k: [list(s) for s in v] for k, v in timeline.rows(events).items()},
                    timeline.step_starts(events), timeline.overlap(events))


def traced(gpu: Workload, cpu: Workload) -> tuple[TraceRow, records.Source]:
    """The profiled step: the record's (two GPUs, a step graph); two GPUs' with
    TUTORIAL_MEASURE=1 at ``gpu``; without a record, two CPU processes at ``cpu``."""
    (row,), source = records.measured(
        TRACE, lambda: [measure_trace(gpu, "cuda")], gpus=2, cfg=gpu, row_type=TraceRow,
        stand_in=lambda: [measure_trace(cpu, "cpu")])
    return row, source


def best_run(runs: list[Run], regime: str, method: str = "DDP", mode: str | None = None,
             gpus: int | None = None, batch: int | None = None) -> Run | None:
    """The fastest run matching the filters (``None`` matches anything), or None."""
    found = [r for r in runs if (r.regime, r.method) == (regime, method)
             and mode in (None, r.mode) and gpus in (None, r.gpus)
             and batch in (None, r.per_gpu_batch)]
    return max(found, key=lambda r: r.per_gpu_batch * r.gpus / r.step_ms, default=None)


def summary(runs: list[Run], global_batch: int, model: str = "wrn-28-10",
            gpu: str | None = None) -> dict[str, float | str | int]:
    """Flat summary for the chapter's prose: single-GPU steps, then each regime's speed-ups;
    with ``gpu``, the GPU that measured ``model``'s steps, the MFU (%) of the best single-GPU
    run and of each regime's fastest DDP run (NaN where unknown)."""
    nan = float("nan")
    out: dict[str, float | str | int] = _mfus(runs, global_batch, model, gpu)
    for name, batch in (("ref", global_batch), ("half", global_batch // 2)):
        eager = best_run(runs, "single", "1 GPU", "eager", batch=batch)
        out[f"batch_{name}"] = batch
        out[f"eager_{name}_ms"] = eager.step_ms
        for mode, key in (("CUDA graphs", "graphs"), (STEP_GRAPH, "whole")):
            r = best_run(runs, "single", "1 GPU", mode, batch=batch)
            out[f"{key}_{name}_ms"] = r.step_ms if r else nan
            gain = "graph_gain" if key == "graphs" else "whole_gain"
            out[f"{gain}_{name}"] = eager.step_ms / r.step_ms if r else nan
    multi = sorted({r.gpus for r in runs if r.regime != "single"})
    for tag, n in (("2", multi[0]), ("max", multi[-1])):
        for regime in ("strong", "weak"):
            best = best_run(runs, regime, gpus=n)
            dp = best_run(runs, regime, "DataParallel", gpus=n)
            out |= {f"{regime}_{tag}_x": best.speedup, f"{regime}_{tag}_mode": best.mode,
                    f"{regime}_{tag}_pred": best.predicted,
                    f"{regime}_{tag}_dp": dp.speedup if dp else nan}
            for mode, key in (("eager", "eager"), ("CUDA graphs", "graphs"), (STEP_GRAPH, "whole")):
                r = best_run(runs, regime, mode=mode, gpus=n)
                out[f"{regime}_{tag}_{key}_x"] = r.speedup if r else nan
                out[f"{regime}_{tag}_{key}_pred"] = r.predicted if r else nan
                out[f"{regime}_{tag}_{key}_ms"] = r.step_ms if r else nan
    out["bench_n_max"] = multi[-1]
    out["strong_max_per_gpu"] = global_batch // multi[-1]
    return out


def _mfus(runs: list[Run], global_batch: int, model: str, gpu: str | None) -> dict[str, float]:
    """MFU (%) of the fastest single-GPU run at the global batch and of the fastest DDP run of
    each regime on the fewest GPUs."""
    n = min(r.gpus for r in runs if r.regime != "single")
    picks = {"single_ref_mfu": best_run(runs, "single", "1 GPU", batch=global_batch),
             "strong_2_mfu": best_run(runs, "strong", gpus=n),
             "weak_2_mfu": best_run(runs, "weak", gpus=n)}
    return {k: mfu.percent(run_mfu(r, model, gpu) if r else None) for k, r in picks.items()} | {
        "mfu_gpu": mfu.short_name(gpu)}


COLUMNS = (Column("regime", "regime", width=7, left=True),
           Column("method", "method", width=13, left=True),
           Column("mode", "mode", width=12, left=True), Column("gpus", "GPUs", "d", 5),
           Column("per_gpu_batch", "batch/GPU", "d", 10), Column("step_ms", "step ms", ".2f", 9),
           Column("images_per_s", "img/s", ".0f", 8), mfu.COLUMN,
           Column("epoch_s", "epoch s", ".2f", 9),
           Column("speedup", "speed-up", ".2f", 9, unit="x", missing=""),
           Column("predicted", "predicted", ".2f", 10, unit="x", missing=""))


def run_mfu(r: Run, model: str, gpu: str | None) -> float | None:
    """The MFU of a run's step on its GPUs (None where no GPU measured)."""
    return mfu.wrn_images(r.images_per_s, model, gpu, r.gpus)


def table_of(runs: list[Run], model: str = "wrn-28-10", gpu: str | None = None) -> str:
    """One line per run; epoch s: the 50,000 training images at this rate; MFU: with ``gpu``,
    the GPU that measured ``model``'s steps."""
    lines = table([dataclasses.asdict(r) | {"images_per_s": r.images_per_s,
                                            "epoch_s": r.epoch_s, "mfu": run_mfu(r, model, gpu)}
                   for r in runs], COLUMNS)
    return lines + "\n" + mfu.note(gpu, mfu.wrn_flops_text(model, [r.per_gpu_batch
                                                                 for r in runs]))


def plot(runs: list[Run], title: str):
    """Speed-up of each multi-GPU run over the best single GPU, by regime and GPU count."""
    import matplotlib.pyplot as plt

    multi = [r for r in runs if r.regime != "single"]
    groups = sorted({(r.regime, r.gpus) for r in multi}, key=lambda g: (g[0] != "strong", g[1]))
    kinds = sorted({(r.method, r.mode) for r in multi}, reverse=True)
    fig, ax = plt.subplots(figsize=(8, 3.6))
    width = 0.8 / len(kinds)
    predicted_label = "predicted (no overlap)"  # on the first tick drawn, whichever run it is
    for k, (method, mode) in enumerate(kinds):
        for g, (regime, gpus) in enumerate(groups):
            r = next((r for r in multi if (r.regime, r.gpus, r.method, r.mode)
                      == (regime, gpus, method, mode)), None)
            if r is None:
                continue
            x = g + (k - (len(kinds) - 1) / 2) * width
            ax.bar(x, r.speedup, width, color=f"C{k}",
                   label=f"{method}, {mode}" if g == 0 else None)
            if r.predicted:
                ax.plot(x, r.predicted, "k_", ms=12, mew=2, label=predicted_label)
                predicted_label = None
    for g, (_, gpus) in enumerate(groups):
        ax.hlines(gpus, g - 0.45, g + 0.45, colors="grey", linestyles=":",
                  label="perfect scaling" if g == 0 else None)
    ax.set_xticks(range(len(groups)), [f"{regime}\n{gpus} GPUs" for regime, gpus in groups])
    ax.set_ylabel("speed-up over the best 1-GPU run")
    ax.set_title(title, fontsize=9)
    legend_outside(ax, fontsize=7)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> None:
    cfg = parse_or_exit(ScalingConfig, argv, __spec__.name, ScalingConfig.check_machine)
    if cfg.trace:
        return _trace_main(cfg)
    if gpu_count() == 0 and set(cfg.modes) & set(GPU_ONLY_MODES):
        print("no GPU: the CUDA-graph runs are left out")
    runs = run(cfg)
    print(table_of(runs, cfg.model, mfu.this_gpu() if cfg.on == "cuda" else None))
    print("\npredicted: DDP with no overlap of compute and all-reduce (chapter 4's model)")
    if cfg.record:
        path = records.write(RECORD, cfg, runs, __spec__.name, [STEP_TIMING], gpus=max(cfg.gpus),
                             what=WHAT)
        print(f"wrote {path}")


def _trace_main(cfg: ScalingConfig) -> None:
    step = Workload(cfg.model, cfg.global_batch // 2, cfg.warmup, cfg.repeats)
    row = measure_trace(step, cfg.on)
    print(f"DDP step {row.ddp_ms:.2f} ms on {row.where}, communication alone "
          f"{row.shares['exposed_ms']:.2f} ms per step")
    if cfg.record:
        path = records.write(TRACE, cfg, [row], __spec__.name, [STEP_TIMING], gpus=2,
                             what="Chapter 5b: a profiler timeline of one DDP step on two GPUs")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
