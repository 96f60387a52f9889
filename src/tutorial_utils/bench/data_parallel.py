"""Data parallelism on one machine, measured side by side in one run.

    python -m tutorial_utils.bench.data_parallel --gpus 2 --batch 256

Times one training step of a Wide-ResNet (bf16 autocast, channels_last) at a fixed per-GPU
batch: on one GPU (eager, and with CUDA graphs), with ``nn.DataParallel`` over N GPUs (cuDNN
autotuning on and off), and with DDP in N processes; every speed-up is against the best
single-GPU run of the same invocation. It also predicts the DDP step from the compute time and
a ring all-reduce at the measured bus bandwidth.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..config import check, check_gpus, opt, parse_or_exit
from ..devices import gpu_count
from ..parallel.collectives import ring_all_reduce_seconds
from . import mfu, records, workload
from .ddp_timing import STEP_TIMING, ddp_step, time_ddp
from .report import Column, legend_outside, table
from .workers.step_timing import StepTiming
from .workload import Workload

RECORD = "04-data-parallel"
WHAT = ("Chapter 4: a WRN-28-10 training step on one GPU, and with DataParallel and DDP on two")


@dataclass
class DataParallelConfig(Workload):
    """Data parallelism on one machine, measured side by side in one run."""

    batch: int = opt(256, "images per GPU and step")
    gpus: int = opt(2, "GPUs for DataParallel and DDP (CPU processes on a machine without GPUs)")
    graphs: bool = opt(True, "also time the network as CUDA graphs (GPU only)")
    record: bool = opt(False, f"write the result as the record {RECORD} (book/data)")

    def __post_init__(self) -> None:
        super().__post_init__()
        check((self.gpus >= 2, f"--gpus must be >= 2 (data parallelism needs two), got "
               f"{self.gpus}"))

    def check_machine(self) -> None:
        """One GPU per process; only a machine without GPUs runs CPU processes instead."""
        if gpu_count():
            check_gpus(self.gpus, "--gpus", "CUDA_VISIBLE_DEVICES= for CPU processes", fewest=2)


@dataclass
class DdpRow(StepTiming):
    """The fastest DDP run, and chapter 4's model of it: compute, then a ring all-reduce."""

    mode: str = "eager"
    best_single_ms: float = 0.0  # the best one-GPU step of the same invocation
    allreduce_ms: float = 0.0  # the ring model at the measured bus bandwidth
    eager_ddp_ms: float = 0.0
    eager_no_sync_ms: float = 0.0
    predicted_no_overlap_ms: float = 0.0
    predicted_full_overlap_ms: float = 0.0
    predicted_speedup_no_overlap: float = 0.0
    predicted_speedup_full_overlap: float = 0.0
    measured_speedup: float = 0.0


@dataclass
class Row:
    name: str
    gpus: int
    step_ms: float | None
    images_per_s: float | None = None
    speedup: float | None = None  # over the best single-GPU row
    note: str = ""


def run(size: DataParallelConfig, cpu: bool = False) -> tuple[list[Row], DdpRow]:
    """All measurements; returns the table rows and the record of the fastest DDP run, with
    the prediction of chapter 4's model for it."""
    n_gpus, graphs = size.gpus, size.graphs
    # Everything on GPUs when there are enough for DDP, else everything in CPU processes.
    device = "cuda" if gpu_count() >= n_gpus and not cpu else "cpu"
    on_gpu = device == "cuda"
    dev = torch.device("cuda:0" if on_gpu else "cpu")
    singles = [workload.measure_rung(workload.LADDER[3], size, dev)]
    if graphs and on_gpu:
        singles.append(workload.measure_rung(workload.LADDER[-1], size, dev))
    rows = [Row(f"1 GPU, {r.rung.lstrip('+ ')}" if on_gpu else f"CPU, {r.rung}", 1, r.ms)
            for r in singles]
    if on_gpu:
        for flag in (True, False):
            ms = workload.time_data_parallel(size, n_gpus, cudnn_benchmark=flag)
            rows.append(Row(f"DataParallel, cudnn.benchmark={flag}", n_gpus, ms))
    else:
        rows.append(Row("DataParallel", n_gpus, None, note=f"skipped: needs {n_gpus} GPUs"))
    # The same optimisation on both sides: eager DDP against the eager GPU, CUDA graphs
    # (torch.compile "reduce-overhead" inside DDP) against the CUDA-graph GPU.
    modes = {"eager": "none", "CUDA graphs": "reduce-overhead"} if graphs and on_gpu else {
        "eager": "none"}
    runs: dict[str, StepTiming] = {}
    for mode, compile_mode in modes.items():
        rec = runs[mode] = time_ddp(ddp_step(size, device, compile_mode), n_gpus)
        suffix = "" if mode == "eager" else f", {mode}"
        rows.append(Row(f"DDP{suffix}", n_gpus, rec.ddp_ms))
        rows.append(Row(f"DDP{suffix}, no_sync (compute only)", n_gpus, rec.no_sync_ms))
    best = min(r.step_ms for r in rows if r.gpus == 1)
    for r in rows:
        if r.step_ms:
            r.images_per_s = size.batch * r.gpus / r.step_ms * 1e3
            r.speedup = r.images_per_s / (size.batch / best * 1e3)
    mode, fastest = min(runs.items(), key=lambda kv: kv[1].ddp_ms)
    return rows, ddp_model(fastest, mode, best, runs["eager"])


def ddp_model(rec: StepTiming, mode: str, best: float, eager: StepTiming) -> DdpRow:
    """Chapter 4's prediction for ``rec``: no overlap (compute, then the all-reduce) and full
    overlap (the longer of the two), each as a speed-up over the best one-GPU step."""
    n = rec.world_size
    allreduce_ms = ring_all_reduce_seconds(rec.grad_bytes, n, rec.bus_gbps) * 1e3
    low, high = rec.no_sync_ms + allreduce_ms, max(rec.no_sync_ms, allreduce_ms)
    return DdpRow(**dataclasses.asdict(rec), mode=mode, best_single_ms=best,
                  allreduce_ms=allreduce_ms, eager_ddp_ms=eager.ddp_ms,
                  eager_no_sync_ms=eager.no_sync_ms, predicted_no_overlap_ms=low,
                  predicted_full_overlap_ms=high, predicted_speedup_no_overlap=n * best / low,
                  predicted_speedup_full_overlap=n * best / high,
                  measured_speedup=n * best / rec.ddp_ms)


def summary(rows: list[Row], ddp: DdpRow, size: Workload,
            gpu: str | None = None) -> dict[str, float | str]:
    """Flat summary for chapter 4's prose (NaN where a run was skipped); with ``gpu``, the GPU
    that measured, the MFU (%) of the best single GPU and of the fastest DDP run."""
    nan = float("nan")
    by_name = {r.name: r for r in rows}
    best = min((r for r in rows if r.gpus == 1), key=lambda r: r.step_ms)
    on, off = (by_name.get(f"DataParallel, cudnn.benchmark={flag}") for flag in (True, False))
    n = ddp.world_size
    out = {"dp_workload": f"{size.model.upper()}, {size.batch} images per GPU",
           "best_single": best.name, "best_single_ms": best.step_ms, "n_gpus_dp": n,
           "dp_on_over_off": on.step_ms / off.step_ms if on and off else nan}
    for key, r in (("dp_on", on), ("dp_off", off)):
        out |= {f"{key}_ms": r.step_ms if r else nan, f"{key}_x": r.speedup if r else nan}
    return out | {
        "ddp_ms": ddp.ddp_ms, "ddp_x": ddp.measured_speedup, "ddp_mode": ddp.mode,
        "nosync_ms": ddp.no_sync_ms, "grad_mb": ddp.grad_bytes / 1e6,
        "bus_gbps": ddp.bus_gbps, "allreduce_ms": ddp.allreduce_ms,
        "pred_lo": ddp.predicted_speedup_no_overlap,
        "pred_hi": ddp.predicted_speedup_full_overlap,
        "exposed_ms": ddp.ddp_ms - ddp.no_sync_ms,
        "eager_ddp_ms": ddp.eager_ddp_ms, "eager_nosync_ms": ddp.eager_no_sync_ms,
        "eager_ddp_x": n * best.step_ms / ddp.eager_ddp_ms,
        "best_single_mfu": mfu.percent(row_mfu(best, size.model, gpu)),
        "mfu_gpu": mfu.short_name(gpu),
        "ddp_mfu": mfu.percent(mfu.mfu(mfu.wrn_step_flops(size.model, ddp.per_gpu_batch * n),
                                    ddp.ddp_ms, gpu, n))}


COLUMNS = (Column("name", "run", width=42, left=True), Column("gpus", "GPUs", "d", 5),
           Column("step_ms", "step (ms)", ".2f", 11), Column("images_per_s", "images/s", ".0f"),
           mfu.COLUMN, Column("speedup", "vs best 1-GPU", ".2f", 15, unit="x"),
           Column("note", "", width=2, left=True, missing=""))


def row_mfu(r: Row, model: str, gpu: str | None) -> float | None:
    """The MFU of a row's step (its images/s on its GPUs), or None (no GPU, not measured)."""
    if r.images_per_s is None or r.name.startswith("CPU"):
        return None
    return mfu.wrn_images(r.images_per_s, model, gpu, r.gpus)


def table_of(rows: list[Row], model: str = "wrn-28-10", gpu: str | None = None) -> str:
    """One line per run; with ``gpu``, the GPU that measured, each run's MFU (``model``: the
    network the rows timed), and a line that says what MFU divides by."""
    lines = table([dataclasses.asdict(r) | {"note": f"  {r.note}" if r.note else "",
                                            "mfu": row_mfu(r, model, gpu)} for r in rows],
                  COLUMNS)
    batches = [round(r.images_per_s * r.step_ms / 1e3 / r.gpus) for r in rows if r.step_ms][:1]
    return lines + "\n" + mfu.note(gpu, mfu.wrn_flops_text(model, batches))


def rows_of(rows: list[Row], ddp: DdpRow) -> list[dict]:
    """The table's rows, then the DDP model's (labelled by its kind), as the record stores them."""
    return [dataclasses.asdict(r) for r in rows] + [dataclasses.asdict(ddp) | {"kind": "ddp"}]


def from_rows(rows: list[dict]) -> tuple[list[Row], DdpRow]:
    table_rows = [records.from_row(Row, r) for r in rows if "kind" not in r]
    (ddp,) = [records.from_row(DdpRow, {k: v for k, v in r.items() if k != "kind"})
              for r in rows if r.get("kind") == "ddp"]
    return table_rows, ddp


def measured(cfg: DataParallelConfig) -> tuple[list[Row], DdpRow, records.Source]:
    """Chapter 4's timings on ``cfg.gpus`` GPUs: the record's; this machine's with
    TUTORIAL_MEASURE=1; without a record, in CPU processes at ``cfg``'s size."""
    rows, source = records.measured(
        RECORD, lambda: rows_of(*run(cfg)), gpus=cfg.gpus, cfg=cfg,
        stand_in=lambda: rows_of(*run(cfg, cpu=True)),
        compare=records.Compare(("name",), "step_ms", "run: step ms"))
    return (*from_rows(rows), source)


def plot(rows: list[Row], ddp: DdpRow, title: str):
    """Images/s of each run, with the band the all-reduce model predicts for DDP."""
    import matplotlib.pyplot as plt

    measured = [r for r in rows if r.step_ms is not None]
    fig, ax = plt.subplots(figsize=(7.5, 3.4))
    ax.barh([r.name for r in measured], [r.images_per_s for r in measured], color="#4c72b0")
    n, per_gpu = ddp.world_size, ddp.per_gpu_batch
    lo, hi = (n * per_gpu / ms * 1e3 for ms in (ddp.predicted_no_overlap_ms,
                                                ddp.predicted_full_overlap_ms))
    ax.axvspan(lo, hi, color="#dd8452", alpha=0.3,
               label=f"DDP ({ddp.mode}) predicted: no to full overlap")
    for i, r in enumerate(measured):
        ax.annotate(f" {r.speedup:.2f}x", (r.images_per_s, i), va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("training images / s")
    ax.set_title(title, fontsize=9)
    ax.margins(x=0.15)
    legend_outside(ax, "below")  # beside, it would squeeze the bars; inside, it hides them
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> None:
    cfg = parse_or_exit(DataParallelConfig, argv, __spec__.name,
                        DataParallelConfig.check_machine)
    rows, ddp = run(cfg)
    print(table_of(rows, cfg.model, mfu.this_gpu()))
    print(f"\nall-reduce of {ddp.grad_bytes / 1e6:.0f} MB at {ddp.bus_gbps:.0f} GB/s bus "
          f"bandwidth: {ddp.allreduce_ms:.2f} ms; DDP speed-up predicted "
          f"{ddp.predicted_speedup_no_overlap:.2f}x (no overlap) to "
          f"{ddp.predicted_speedup_full_overlap:.2f}x (full overlap), "
          f"measured {ddp.measured_speedup:.2f}x (DDP, {ddp.mode})")
    if cfg.record:
        path = records.write(RECORD, cfg, rows_of(rows, ddp), __spec__.name, [STEP_TIMING],
                             gpus=cfg.gpus, what=WHAT)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
