"""Chapter 5c's measurements: the memory of a training step per batch size, and checkpointing.

    python -m tutorial_utils.bench.memory --record     # remakes the chapter's four records

:func:`activation_curve` measures one :func:`~tutorial_utils.memory.breakdown` per batch
size, each with a fresh network and nothing else alive on the device; :func:`checkpoint_cost`
measures the plain network against checkpointed ones, bytes and step time;
:func:`allocator_trace` records the CUDA allocator's history over a few steps. On a GPU these
are GPU measurements, which the chapter reads from records (:mod:`.records`); without a record
the breakdowns are counted on the CPU instead, with no allocator peak. The rest presents:
tables, the figures, and the flat summaries the chapter glues.
"""

from __future__ import annotations

import dataclasses
import gc
from dataclasses import dataclass

import torch

from ..config import Config, check, check_wrn, opt, parse_or_exit
from ..memory import (
    PARTS,
    Breakdown,
    allocation_timeline,
    breakdown,
    checkpointed,
    fragmentation,
    record_allocations,
    zero_table,
)
from ..models.wrn import wide_resnet
from ..step import train_step
from ..timing import benchmark, cudnn_autotuning
from . import mfu, records
from .report import Column, legend_outside, table

MiB, GiB = 2**20, 2**30
LABELS = {"parameters": "parameters", "gradients": "gradients", "optimizer": "optimizer state",
          "weight_copies": "bf16 weight copies", "activations": "activations"}


NAMES = ("05c-curve", "05c-wide", "05c-checkpointing", "05c-allocator")
WHAT = ("Chapter 5c: the bytes of one training step per batch size, and the allocator's peak",
        "Chapter 5c: the bytes of one training step of a twice wider network",
        "Chapter 5c: activation checkpointing, memory against step time",
        "Chapter 5c: the CUDA allocator's history over steps of growing batches")


@dataclass
class MemoryConfig(Config):
    """Chapter 5c's measurements on one GPU, each written as one of its records."""

    model: str = opt("wrn-28-10", "the network, WRN-depth-width")
    batches: tuple[int, ...] = opt((32, 64, 128, 256, 512, 1024), "batch sizes of the curve")
    ref: int = opt(128, "the batch the chapter discusses, one of --batches")
    wide: str = opt("wrn-28-20", "the wider network, measured at --ref")
    ckpt_batch: int = opt(512, "the batch of the checkpointing comparison")
    segments: tuple[int, ...] = opt((0, 1, 4), "blocks per checkpointed segment (0: plain)")
    warmup: int = opt(5, "untimed steps first")
    repeats: int = opt(20, "timed steps; the median is reported")
    alloc_batches: tuple[int, ...] = opt((128, 192, 256), "the allocator's steps, in order")
    record: bool = opt(False, f"write the results as the records {', '.join(NAMES)}")

    def __post_init__(self) -> None:
        check_wrn(self.model)
        check_wrn(self.wide, "--wide")
        check((self.ref in self.batches, f"--ref {self.ref} must be one of --batches"),
              (all(b >= 1 for b in (*self.batches, self.ckpt_batch, *self.alloc_batches)),
               "every batch must be >= 1"),
              (len(self.segments) >= 2 and self.segments[0] == 0,
               "--segments must start with 0 (the plain network) and name one more"),
              (self.repeats >= 1, f"--repeats must be >= 1, got {self.repeats}"))


@dataclass
class CheckpointRow:
    segment: int  # blocks per checkpointed segment; 0: the plain network
    step_ms: float
    breakdown: Breakdown


@dataclass
class AllocatorTrace:
    batches: list[int]
    timeline: list[list[int]]  # (allocated, reserved) bytes after each allocator event
    ends: list[int]  # the event at which each step ended
    state: dict[str, int]  # reserved, allocated, free and the largest free block at the end
    figure_png: str | None = None  # only in a record made from a chapter's stored figure


def build(model_name: str, batch: int, device, segment: int = 0):
    """A WRN in channels_last (checkpointed if ``segment``), SGD as the book trains, a batch."""
    torch.manual_seed(0)
    net = wide_resnet(model_name).to(device, memory_format=torch.channels_last)
    model = checkpointed(net, segment) if segment else net
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    x = torch.randn(batch, 3, 32, 32, device=device).to(memory_format=torch.channels_last)
    return model, optimizer, (x, torch.randint(0, 10, (batch,), device=device))


def release(device) -> None:
    """Free what the last measurement left, so the next peak counts only its own tensors."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def activation_curve(model_name: str, batches, device="cpu", segment: int = 0) -> list[Breakdown]:
    """One breakdown per batch size, each with a fresh model, as the book trains."""
    out = []
    with cudnn_autotuning():
        for batch in batches:
            release(device)
            model, optimizer, data = build(model_name, batch, device, segment)
            out.append(breakdown(model, optimizer, data, name=model_name))
            del model, optimizer, data
    release(device)
    return out


def checkpoint_cost(model_name: str, batch: int, device="cpu", segments=(0, 1),
                    warmup: int = 3, repeats: int = 10) -> list[CheckpointRow]:
    """Breakdown and median step time (ms) of the plain network (segment 0) and checkpointed."""
    rows = []
    for segment in segments:
        (mem,) = activation_curve(model_name, [batch], device, segment)
        with cudnn_autotuning():
            model, optimizer, (x, y) = build(model_name, batch, device, segment)
            timing = benchmark(lambda m=model, o=optimizer, a=x, b=y: train_step(m, o, a, b),
                               warmup=warmup, repeats=repeats, device=device)
        rows.append(CheckpointRow(segment, timing.median_ms, mem))
        del model, optimizer, x, y
        release(device)
    return rows


def allocator_trace(model_name: str, batches, device) -> AllocatorTrace:
    """One training step at each batch of ``batches`` in turn, on one network, with the CUDA
    allocator's history recorded: (allocated, reserved) after every event, the event at which
    each step ended, and the segments' state at the end (:func:`~tutorial_utils.memory.
    fragmentation`). A batch that grows from step to step is what a data set of varying sizes
    (or a growing sequence length) does: the blocks the last step freed are too small for it."""
    release(device)
    out = _record_steps(model_name, list(batches), device)
    release(device)  # the network and its optimizer are gone with the call
    return out


def _record_steps(model_name: str, batches: list[int], device) -> AllocatorTrace:
    model, optimizer, _ = build(model_name, batches[0], device)
    dev = torch.device(device).index or 0
    ends, queue = [], list(batches)

    def step():
        batch = queue.pop(0)
        x = torch.randn(batch, 3, 32, 32, device=device).to(memory_format=torch.channels_last)
        train_step(model, optimizer, x, torch.randint(0, 10, (batch,), device=device))
        ends.append(len(torch.cuda.memory._snapshot()["device_traces"][dev]))

    with cudnn_autotuning():
        snap = record_allocations(step, steps=len(batches))
    timeline = [list(point) for point in allocation_timeline(snap, dev)]
    return AllocatorTrace(batches, timeline, ends, fragmentation(snap))


def plot_allocator(trace: AllocatorTrace, title: str):
    """Allocated against reserved memory over the allocator's events, one shade per step (a
    record made from a chapter's stored output holds the figure as that output showed it)."""
    if trace.figure_png:
        import base64

        from IPython.display import Image

        return Image(data=base64.b64decode(trace.figure_png))
    import matplotlib.pyplot as plt

    allocated, reserved = zip(*trace.timeline, strict=True)
    fig, ax = plt.subplots(figsize=(7.5, 3.4))
    ax.plot([a / MiB for a in allocated], lw=0.8, label="allocated (live tensors)")
    ax.plot([r / MiB for r in reserved], lw=1.6, label="reserved (the allocator's segments)")
    start = 0
    for i, (batch, end) in enumerate(zip(trace.batches, trace.ends, strict=True)):
        if i % 2:
            ax.axvspan(start, end, color="0.93", zorder=0)
        ax.text((start + end) / 2, 0.02, f"batch {batch}", transform=ax.get_xaxis_transform(),
                ha="center", fontsize=8)
        start = end
    ax.set_xlabel("allocator event (allocations and frees, in order)")
    ax.set_ylabel("MiB added since recording began")
    ax.set_title(title, fontsize=10)
    legend_outside(ax)
    fig.tight_layout()
    return fig


def predicted_activations(model_name: str, batch: int) -> int:
    """Bytes a WRN keeps for backward in bf16: four feature maps per residual block.

    Each block saves its input and its first ReLU's output (at the input's size), its first
    convolution's output and its second ReLU's output (at the output's size); the head saves
    the last block's output and the final ReLU's; the stem a bf16 copy of the images.
    """
    _, depth, k = model_name.split("-")
    n, widths = (int(depth) - 4) // 6, [16, 16 * int(k), 32 * int(k), 64 * int(k)]
    elements, side = 3 * 32 * 32, 32
    for group in range(3):
        for i in range(n):
            elements += 2 * (widths[group] if i == 0 else widths[group + 1]) * side**2
            side //= 2 if (group > 0 and i == 0) else 1
            elements += 2 * widths[group + 1] * side**2
    return 2 * batch * (elements + 2 * widths[3] * side**2)


def fit_line(curve: list[Breakdown], key: str = "total") -> tuple[float, float]:
    """Least-squares ``bytes = slope * batch + intercept`` over the curve (``key``: a part,
    ``total`` or ``peak``); NaN for fewer than two batch sizes."""
    xs = [float(b.batch) for b in curve]
    ys = [float(getattr(b, key)) for b in curve]
    if len(set(xs)) < 2:
        return float("nan"), float("nan")
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs)
    return slope, my - slope * mx


def curve_table(curve: list[Breakdown]) -> str:
    """One line per breakdown, in MiB; the peak is '-' where it was not measured (CPU)."""
    cols = [Column("model", "model", width=10, left=True), Column("batch", "batch", width=6)]
    heads = ("params", "grads", "optim", "bf16 copies", "activations")
    cols += [Column(p, h, ".1f", 12 if len(h) > 9 else 10)
             for p, h in zip(PARTS, heads, strict=True)]
    cols += [Column("total", "sum", ".1f", 9), Column("peak", "peak", ".1f", 9),
             Column("ratio", "peak/sum", ".3f", 9)]
    rows = [{"model": b.model.upper(), "batch": b.batch, "total": b.total / MiB,
             "peak": b.peak / MiB if b.peak else None,
             "ratio": b.peak / b.total if b.peak else None,
             **{p: getattr(b, p) / MiB for p in PARTS}} for b in curve]
    return "all sizes in MiB\n" + table(rows, cols)


def plot_curve(curve: list[Breakdown], title: str):
    """Stacked bars of the parts per batch size, the measured peak as a marker on each."""
    import matplotlib.pyplot as plt

    unit, name = (GiB, "GiB") if max(b.total for b in curve) > GiB else (MiB, "MiB")
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    xs, bottom = range(len(curve)), [0.0] * len(curve)
    for part in PARTS:
        values = [getattr(b, part) / unit for b in curve]
        ax.bar(xs, values, bottom=bottom, label=LABELS[part], width=0.6)
        bottom = [a + v for a, v in zip(bottom, values, strict=True)]
    peaks = [(i, b.peak / unit) for i, b in zip(xs, curve, strict=True) if b.peak]
    if peaks:
        ax.plot(*zip(*peaks, strict=True), "k_", markersize=28, markeredgewidth=2.5,
                label="measured peak")
    else:
        ax.text(0.02, 0.95, "peak not measured: no GPU", transform=ax.transAxes, va="top")
    ax.set_xticks(list(xs), [str(b.batch) for b in curve])
    ax.set_xlabel("batch size (images)")
    ax.set_ylabel(f"memory ({name})")
    ax.set_title(title, fontsize=10)
    legend_outside(ax)
    fig.tight_layout()
    return fig


def segment_label(segment: int) -> str:
    return "plain" if segment == 0 else f"checkpoint every {segment} block(s)"


def checkpoint_mfu(r: CheckpointRow, gpu: str | None) -> float | None:
    """A row's MFU on the GPU named ``gpu``: the network's model FLOPs, the recomputed forward
    not counted."""
    return mfu.mfu(mfu.wrn_step_flops(r.breakdown.model, r.breakdown.batch), r.step_ms, gpu)


def checkpoint_table(rows: list[CheckpointRow], gpu: str | None = None) -> str:
    """Per network: bytes saved for backward, peak, step time, its MFU on the GPU named
    ``gpu`` (model FLOPs: recomputation not counted), time against the plain network."""
    cols = [Column("label", "network", width=30, left=True), Column("act", "saved MiB", ".1f", 11),
            Column("peak", "peak MiB", ".1f", 10), Column("ms", "step ms", ".1f", 9),
            mfu.COLUMN, Column("slower", "time", ".2f", 7)]
    base, b = rows[0].step_ms, rows[0].breakdown
    lines = table([{"label": segment_label(r.segment), "ms": r.step_ms, "slower": r.step_ms / base,
                    "act": (r.breakdown.activations + r.breakdown.weight_copies) / MiB,
                    "peak": r.breakdown.peak / MiB if r.breakdown.peak else None,
                    "mfu": checkpoint_mfu(r, gpu)} for r in rows], cols)
    return lines + "\n" + mfu.note(gpu, mfu.wrn_flops_text(b.model, [b.batch])
                                   + "; the recomputed forward is not counted")


def plot_checkpointing(rows: list[CheckpointRow], title: str):
    """Memory against step time, one point per network (the peak on a GPU, else the sum)."""
    import matplotlib.pyplot as plt

    measured = all(r.breakdown.peak for r in rows)
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for r in rows:
        b = r.breakdown
        ax.plot(r.step_ms, (b.peak if measured else b.total) / MiB, "o", markersize=9,
                label=segment_label(r.segment))
    ax.set_xlabel("training step (ms, median)")
    ax.set_ylabel("measured peak (MiB)" if measured else "sum of the parts (MiB, no GPU)")
    ax.set_title(title, fontsize=10)
    legend_outside(ax)
    ax.margins(0.2)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    fig.tight_layout()
    return fig


def batchnorm_updates(model_name: str, segment: int) -> int:
    """Batches the first BatchNorm has counted after one training step (1 without recompute)."""
    model, optimizer, (x, y) = build(model_name, 2, "cpu", segment)
    train_step(model, optimizer, x, y)
    return int(next(m for m in model.modules()
                    if isinstance(m, torch.nn.BatchNorm2d)).num_batches_tracked)


def zero_text(n_params: int, world_sizes=(2, 8), precision: str = "fp32") -> str:
    """Bytes per parameter and MiB per rank of the model state, per optimizer and stage."""
    cols = [Column("optimizer", "optimizer", width=10, left=True),
            Column("stage", "stage", width=11, left=True)]
    rows: dict[tuple, dict] = {}
    for n in world_sizes:
        cols += [Column(f"b{n}", f"B/param N={n}", ".2f", 15),
                 Column(f"m{n}", f"MiB/rank N={n}", ".1f", 15)]
        for r in zero_table(n_params, n, precision):
            row = rows.setdefault((r["optimizer"], r["stage"]), {
                "optimizer": "SGD+mom." if r["optimizer"] == "sgd" else "Adam",
                "stage": r["stage"]})
            row |= {f"b{n}": r["bytes_per_param"], f"m{n}": r["bytes_per_rank"] / MiB}
    return table(rows.values(), cols)


def curve_summary(curve: list[Breakdown], ref_batch: int, capacity: int | None) -> dict:
    """The reference batch's parts in MiB, the peak against the sum, the per-image slope,
    and the largest batch a device of ``capacity`` bytes would hold by that line."""
    nan = float("nan")
    ref = next(b for b in curve if b.batch == ref_batch)
    out = {f"{p}_mib": getattr(ref, p) / MiB for p in PARTS}
    state = ref.parameters + ref.gradients + ref.optimizer
    key = "peak" if all(b.peak for b in curve) else "total"
    slope, intercept = fit_line(curve, key)
    out |= {"model": ref.model.upper(), "ref_batch": ref_batch, "total_mib": ref.total / MiB,
            "state_mib": state / MiB, "peak_mib": ref.peak / MiB if ref.peak else nan,
            "peak_over_sum": ref.peak / ref.total if ref.peak else nan,
            "peak_off_pct": 100 * abs(ref.peak / ref.total - 1) if ref.peak else nan,
            "act_share_pct": 100 * ref.activations / ref.total,
            "per_image_mib": slope / MiB, "fixed_mib": intercept / MiB,
            "capacity_gib": capacity / GiB if capacity else nan,
            "largest_batch": int((capacity - intercept) / slope + 1e-9)
            if capacity and slope > 0 else nan,
            "batch_min": curve[0].batch, "batch_max": curve[-1].batch,
            "batch_ratio": curve[-1].batch // curve[0].batch,
            "act_growth": curve[-1].activations / curve[0].activations}
    return out


def checkpoint_summary(rows: list[CheckpointRow], names=("plain", "block", "group"),
                       gpu: str | None = None) -> dict:
    """Per network (named by position): bytes saved for backward, peak, step time, MFU (%, on
    the GPU named ``gpu``), and the memory saved and time lost against the plain network (the
    first row)."""
    nan, out = float("nan"), {}
    base = rows[0]
    for name, r in zip(names, rows, strict=True):
        b, b0 = r.breakdown, base.breakdown
        out |= {f"ck_{name}_segment": r.segment, f"ck_{name}_ms": r.step_ms,
                f"ck_{name}_saved_mib": (b.activations + b.weight_copies) / MiB,
                f"ck_{name}_peak_mib": b.peak / MiB if b.peak else nan,
                f"ck_{name}_saved_frac": (b.activations + b.weight_copies)
                / (b0.activations + b0.weight_copies),
                f"ck_{name}_peak_cut_pct": 100 * (1 - b.peak / b0.peak) if b.peak else nan,
                f"ck_{name}_slower_pct": 100 * (r.step_ms / base.step_ms - 1),
                f"ck_{name}_mfu": mfu.percent(checkpoint_mfu(r, gpu))}
    return out | {"ck_model": base.breakdown.model.upper(), "ck_batch": base.breakdown.batch}


def allocator_summary(trace: AllocatorTrace) -> dict[str, float]:
    peak = max(a for a, _ in trace.timeline) if trace.timeline else trace.state["peak"]
    return {"alloc_peak_mib": peak / MiB, "alloc_reserved_mib": trace.state["reserved"] / MiB,
            "alloc_allocated_mib": trace.state["allocated"] / MiB,
            "alloc_free_mib": trace.state["free"] / MiB,
            "alloc_largest_free_mib": trace.state["largest_free"] / MiB,
            "alloc_events": len(trace.timeline) or trace.state["events"]}


# --- what the chapter calls: the record, or this machine with TUTORIAL_MEASURE=1 --------------

def _gpu() -> torch.device:
    return torch.device("cuda:0")


def curve(cfg: MemoryConfig) -> tuple[list[Breakdown], records.Source]:
    """One breakdown per batch of ``cfg.batches``: the record's (with the GPU's peaks), this
    GPU's, or, with neither, counted on the CPU."""
    return records.measured(
        NAMES[0], lambda: activation_curve(cfg.model, cfg.batches, _gpu()), gpus=1, cfg=cfg,
        row_type=Breakdown, compare=records.Compare(("model", "batch"), "peak", "peak bytes",
                                                    ".3e"),
        stand_in=lambda: activation_curve(cfg.model, cfg.batches, "cpu"),
        stand_in_where="this process")


def wide(cfg: MemoryConfig) -> tuple[list[Breakdown], records.Source]:
    return records.measured(
        NAMES[1], lambda: activation_curve(cfg.wide, [cfg.ref], _gpu()), gpus=1, cfg=cfg,
        row_type=Breakdown, compare=records.Compare(("model", "batch"), "peak", "peak bytes",
                                                    ".3e"),
        stand_in=lambda: activation_curve(cfg.wide, [cfg.ref], "cpu"),
        stand_in_where="this process")


def checkpointing(cfg: MemoryConfig) -> tuple[list[CheckpointRow], records.Source]:
    def measure(device):
        return lambda: checkpoint_cost(cfg.model, cfg.ckpt_batch, device, cfg.segments,
                                       cfg.warmup, cfg.repeats)

    return records.measured(
        NAMES[2], measure(_gpu()), gpus=1, cfg=cfg, row_type=CheckpointRow,
        compare=records.Compare(("segment",), "step_ms", "segment: step ms"),
        stand_in=measure("cpu"), stand_in_where="this process")


def allocator(cfg: MemoryConfig) -> tuple[list[AllocatorTrace], records.Source]:
    """The allocator's history: a GPU's only (the CPU has no caching allocator to record)."""
    return records.measured(
        NAMES[3], lambda: [allocator_trace(cfg.model, cfg.alloc_batches, _gpu())], gpus=1,
        cfg=cfg, row_type=AllocatorTrace)


def main(argv: list[str] | None = None) -> None:
    cfg = parse_or_exit(MemoryConfig, argv, __spec__.name, records.needs_gpus("5c"))
    gpu = _gpu()
    rows = [activation_curve(cfg.model, cfg.batches, gpu),
            activation_curve(cfg.wide, [cfg.ref], gpu),
            checkpoint_cost(cfg.model, cfg.ckpt_batch, gpu, cfg.segments, cfg.warmup,
                            cfg.repeats),
            [allocator_trace(cfg.model, cfg.alloc_batches, gpu)]]
    print(curve_table(rows[0]), checkpoint_table(rows[2], mfu.this_gpu()), sep="\n\n")
    if cfg.record:
        shown = dataclasses.replace(cfg, record=True)
        for name, what, made in zip(NAMES, WHAT, rows, strict=True):
            print(f"wrote {records.write(name, shown, made, __spec__.name, gpus=1, what=what)}")


if __name__ == "__main__":
    main()
