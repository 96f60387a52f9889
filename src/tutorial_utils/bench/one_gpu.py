"""Chapter 2's measurements on one GPU: the toy's numerics, host-to-GPU copies, the three clocks
of one training step, the speed ladder, and the synchronisations a step does not show.

    python -m tutorial_utils.bench.one_gpu --record      # remakes the chapter's five records

The ladder times one full training step (forward, loss, backward, SGD update) of a Wide-ResNet,
adding one optimisation per rung: TF32 matmuls/convs, bf16 autocast, channels_last memory
format, torch.compile, and CUDA graphs. Each rung also records how long the host takes just to
*queue* a step: when that approaches the step time, the GPU is waiting for Python and only fewer
launches (fusion, CUDA graphs) make it faster. Every one of these numbers is a GPU measurement:
the chapter reads them from records (:mod:`.records`) unless ``TUTORIAL_MEASURE=1``.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from dataclasses import dataclass

import torch

from ..config import check, opt, parse_or_exit
from ..timing import (
    benchmark,
    cold_call_ms,
    cudnn_autotuning,
    host_clock_without_sync,
    tf32_enabled,
)
from . import mfu, records
from .report import Column, table
from .workload import LADDER, Rung, RungResult, Workload, make_train_step, measure_rung

NAMES = ("02-numerics", "02-copies", "02-clocks", "02-ladder", "02-sync")


@dataclass
class OneGpuConfig(Workload):
    """Chapter 2's measurements on one GPU, each written as one of its records."""

    warmup: int = opt(10, "untimed steps first")
    repeats: int = opt(30, "timed steps; the median is reported")
    copy_mib: int = opt(512, "MiB copied from host to GPU")
    record: bool = opt(False, f"write the results as the records {', '.join(NAMES)}")

    def __post_init__(self) -> None:
        super().__post_init__()
        check((self.copy_mib >= 1, f"--copy-mib must be >= 1, got {self.copy_mib}"))

    @property
    def size(self) -> Workload:
        return Workload(self.model, self.batch, self.warmup, self.repeats)


# --- the rows each record holds ---------------------------------------------------------------

@dataclass
class Numerics:
    precision: str  # "fp32" or "tf32": TF32 allowed
    rel_err: float  # |GPU - CPU| / |CPU| of the toy network's output


@dataclass
class Copy:
    mib: float
    pinned: bool
    gbps: float


@dataclass
class Clocks:
    workload: str
    cold_ms: float  # the first call
    wrong_ms: float  # the host clock without synchronisation
    right_ms: float  # warmed up, on the GPU's clock: the median
    spread: float  # its interquartile range over the median


@dataclass
class SyncRow:
    step: str
    ms: float
    first_sync: str  # the error the first synchronisation raised, or "none"


# --- the measurements -------------------------------------------------------------------------

@torch.no_grad()
def relative_error(model: torch.nn.Module, x: torch.Tensor, device: torch.device) -> float:
    """How far ``model`` computed on ``device`` lands from the same model on the CPU."""
    reference = model(x)
    out = copy.deepcopy(model).to(device)(x.to(device)).cpu()
    return float((out - reference).norm() / reference.norm())


def measure_numerics(device: torch.device) -> list[Numerics]:
    from ..toy import toy_input, toy_model

    torch.manual_seed(0)
    model, x = toy_model(), toy_input()
    rows = []
    for tf32 in (False, True):
        with tf32_enabled(tf32):
            rows.append(Numerics("tf32" if tf32 else "fp32", relative_error(model, x, device)))
    return rows


def host_to_device_gbps(
    nbytes: int, device: torch.device, pinned: bool, repeats: int = 10
) -> float | None:
    """Copy bandwidth from host memory to ``device`` in GB/s (None on the CPU)."""
    if device.type != "cuda":
        return None
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    timing = benchmark(
        lambda: host.to(device, non_blocking=pinned), warmup=2, repeats=repeats, device=device
    )
    return nbytes / timing.median_ms / 1e6


def measure_copies(mib: int, device: torch.device) -> list[Copy]:
    return [Copy(mib, pinned, host_to_device_gbps(mib * 2**20, device, pinned))
            for pinned in (False, True)]


def measure_clocks(size: Workload, device: torch.device) -> list[Clocks]:
    """One bf16 training step timed three ways: cold, by the host alone, and right."""
    with cudnn_autotuning():
        step = make_train_step(LADDER[2], size, device)
        first = cold_call_ms(step, device)  # cuDNN's algorithm search, allocation
        right = benchmark(step, warmup=size.warmup, repeats=size.repeats, device=device)
        wrong = host_clock_without_sync(step, repeats=3)  # the time to queue, not to run
        torch.cuda.synchronize(device)
    return [Clocks(f"{size.model.upper()}, batch {size.batch}", first, wrong.median_ms,
                   right.median_ms, right.spread)]


def measure_ladder(
    size: Workload, device: torch.device, rungs: tuple[Rung, ...] = LADDER
) -> list[RungResult]:
    """Measure every rung in order (cuDNN autotuning on: the shapes never change)."""
    return [measure_rung(r, size, device) for r in rungs]


def first_sync(step) -> str:
    """The error of the first synchronisation in one call of ``step``, or "none"."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        return "none"
    except RuntimeError as err:
        return str(err).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode(0)


def normalize_each_call(x: torch.Tensor) -> torch.Tensor:
    """Bytes to normalised floats, the statistics copied from the host for every batch."""
    from ..loaders import MEAN, STD

    mean = torch.tensor(MEAN, device=x.device).view(1, 3, 1, 1)
    std = torch.tensor(STD, device=x.device).view(1, 3, 1, 1)
    return (x.float() / 255 - mean) / std


def sync_steps(size: Workload, device: torch.device) -> dict:
    """The channels_last rung's step with a float and a tensor learning rate, and the float
    one fed by each normalisation of a batch of bytes."""
    from ..loaders import normalize

    float_lr = make_train_step(LADDER[3], size, device)  # lr=0.1, foreach SGD
    tensor_lr = make_train_step(LADDER[3], size, device)
    tensor_lr.optimizer.param_groups[0]["lr"] = torch.tensor(0.1, device=device)
    images = torch.randint(0, 256, (size.batch, 3, 32, 32), dtype=torch.uint8, device=device)

    def fed_by(norm):
        return lambda: (float_lr.x.copy_(norm(images)), float_lr())

    return {"lr a number": float_lr, "lr a tensor": tensor_lr,
            "stats per batch": fed_by(normalize_each_call), "stats made once": fed_by(normalize)}


def measure_sync(size: Workload, device: torch.device) -> list[SyncRow]:
    # PyTorch warns once that the mode is a prototype (it does not yet catch every wait).
    warnings.filterwarnings("ignore", message="Synchronization debug mode is a prototype")
    with tf32_enabled(True), cudnn_autotuning():
        steps = sync_steps(size, device)
        times = {name: benchmark(s, warmup=size.warmup, repeats=size.repeats, device=device)
                 for name, s in steps.items()}
        return [SyncRow(name, times[name].median_ms, first_sync(s)) for name, s in steps.items()]


# --- what the chapter calls: the record, or this machine with TUTORIAL_MEASURE=1 --------------

def _read(name: str, measure, row_type: type, cfg, compare: records.Compare):
    return records.measured(name, measure, gpus=1, cfg=cfg, row_type=row_type, compare=compare)


def _gpu() -> torch.device:
    return torch.device("cuda:0")


def numerics() -> tuple[list[Numerics], records.Source]:
    return _read(NAMES[0], lambda: measure_numerics(_gpu()), Numerics, None,
                 records.Compare(("precision",), "rel_err", "relative error", ".1e"))


def copies(cfg: OneGpuConfig) -> tuple[list[Copy], records.Source]:
    return _read(NAMES[1], lambda: measure_copies(cfg.copy_mib, _gpu()), Copy, cfg,
                 records.Compare(("pinned",), "gbps", "pinned: GB/s", ".1f"))


def clocks(cfg: OneGpuConfig) -> tuple[list[Clocks], records.Source]:
    return _read(NAMES[2], lambda: measure_clocks(cfg.size, _gpu()), Clocks, cfg,
                 records.Compare(("workload",), "right_ms", "step ms"))


def ladder(cfg: OneGpuConfig) -> tuple[list[RungResult], records.Source]:
    return _read(NAMES[3], lambda: measure_ladder(cfg.size, _gpu()), RungResult, cfg,
                 records.Compare(("rung",), "ms", "rung: step ms"))


def sync(cfg: OneGpuConfig) -> tuple[list[SyncRow], records.Source]:
    return _read(NAMES[4], lambda: measure_sync(cfg.size, _gpu()), SyncRow, cfg,
                 records.Compare(("step",), "ms", "step ms"))


# --- tables, figure and the prose's numbers ---------------------------------------------------

LADDER_COLUMNS = (Column("rung", "rung", width=18, left=True), Column("ms", "step (ms)", ".2f", 11),
                  Column("iqr", "IQR", ".1%", 7), Column("host", "queue (ms)", ".2f", 12),
                  Column("ips", "images/s", ".0f"), Column("tflops", "TFLOP/s", ".0f", 9),
                  mfu.COLUMN, Column("x", "speed-up", ".2f", unit="x"),
                  Column("note", "", width=2, left=True, missing=""))


def ladder_table(results: list[RungResult], flops: float | None = None,
                 gpu: str | None = None) -> str:
    """Rung, median step time and spread, host queueing time, images/s, speed-up over rung 1;
    with ``flops`` (model FLOPs of one step) the FLOP rate, and its MFU on the GPU ``gpu``."""
    base = results[0].ms
    rows = [{"rung": r.rung, "note": f"  skipped: {r.skipped}"} if r.ms is None else
            {"rung": r.rung, "ms": r.ms, "iqr": r.spread, "host": r.host_ms,
             "ips": r.images_per_s, "x": base / r.ms,
             "tflops": flops / r.ms / 1e9 if flops else None,
             "mfu": mfu.mfu(flops, r.ms, gpu) if flops else None}
            for r in results]
    if not flops:
        return table(rows, LADDER_COLUMNS)
    return table(rows, LADDER_COLUMNS) + "\n" + mfu.note(
        gpu, f"one step: {mfu.gflop(flops)}, forward + backward")


def plot_ladder(results: list[RungResult], title: str):
    """Horizontal bars of images/s per rung, first rung on top, each labelled with its speed-up
    over the first (horizontal, so that the rungs' names never collide)."""
    import matplotlib.pyplot as plt

    measured = [r for r in results if r.ms is not None]
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(measured) + 1.0))
    names = [r.rung for r in measured]
    rates = [r.images_per_s for r in measured]
    bars = ax.barh(names, rates, color="#4c72b0")
    for bar, rate in zip(bars, rates, strict=True):
        ax.annotate(f" {rate / rates[0]:.2f}x", (rate, bar.get_y() + bar.get_height() / 2),
                    ha="left", va="center", fontsize=9)
    ax.invert_yaxis()
    ax.set_xlabel("training images / s")
    ax.set_title(title, fontsize=10)
    ax.margins(x=0.12)
    fig.tight_layout()
    return fig


SLUGS = ("fp32", "tf32", "bf16", "cl", "compile", "graphs")  # glue names of LADDER's rungs


def ladder_summary(results: list[RungResult], flops: float,
                   gpu: str | None = None) -> dict[str, float | str]:
    """Flat summary of a measured ladder for the chapter's prose (NaN where skipped): per rung
    its step, images/s, queueing, speed-up, FLOP rate and MFU (``flops``: model FLOPs of one
    step; ``gpu``: the GPU that measured, NaN MFU where it has no known peak)."""
    nan = float("nan")
    base = results[0].ms
    out: dict[str, float | str] = {}
    for slug, r in zip(SLUGS, results, strict=True):
        ms = r.ms if r.ms is not None else nan
        out |= {f"ladder_{slug}_ips": float(r.images_per_s or nan), f"ladder_{slug}_ms": ms,
                f"ladder_{slug}_host_ms": float(r.host_ms or nan),
                f"ladder_{slug}_x": base / ms, f"ladder_{slug}_tflops": flops / ms / 1e9,
                f"ladder_{slug}_mfu": mfu.percent(mfu.mfu(flops, r.ms, gpu))}
    peak = mfu.peak_of(gpu)
    out |= {"mfu_gpu": mfu.short_name(gpu), "mfu_peak": peak.tflops if peak else nan}
    eager, compiled, graphs = results[3], results[4], results[-1]
    launch_bound = eager.host_ms > 0.8 * eager.ms
    out["cl_verdict"] = ("the GPU is waiting for the CPU" if launch_bound
                         else "the CPU stays ahead of the GPU")
    graphs_ms = graphs.ms if graphs.ms is not None else nan
    first_ms = graphs.first_ms or nan
    gain = eager.ms / compiled.ms
    out |= {"graphs_over_cl": eager.ms / graphs_ms, "graphs_first_s": first_ms / 1e3,
            "graphs_breakeven": break_even_steps(first_ms, eager.ms, graphs_ms),
            "compile_over_cl": gain, "compile_verdict": "shortened" if gain > 1 else "lengthened",
            "compile_first_s": (compiled.first_ms or nan) / 1e3}
    return out


def break_even_steps(first_ms: float, eager_ms: float, fast_ms: float) -> float:
    """Steps after which a slow first step (compilation, capture) has paid for itself: the
    extra first-step time over the time each later step saves (NaN if none is saved)."""
    saved = eager_ms - fast_ms
    return (first_ms - fast_ms) / saved if saved > 0 else float("nan")


def sync_summary(rows: list[SyncRow]) -> dict[str, float]:
    """What a synchronisation cost the step, against the same step without it."""
    ms = {r.step: r.ms for r in rows}
    return {"sync_cost": ms["lr a tensor"] / ms["lr a number"] - 1,
            "stats_cost": ms["stats per batch"] / ms["stats made once"] - 1}


def main(argv: list[str] | None = None) -> None:
    cfg = parse_or_exit(OneGpuConfig, argv, __spec__.name, records.needs_gpus("2"))
    gpu = _gpu()
    results = {NAMES[0]: (measure_numerics(gpu), Numerics),
               NAMES[1]: (measure_copies(cfg.copy_mib, gpu), Copy),
               NAMES[2]: (measure_clocks(cfg.size, gpu), Clocks),
               NAMES[3]: (measure_ladder(cfg.size, gpu), RungResult),
               NAMES[4]: (measure_sync(cfg.size, gpu), SyncRow)}
    print(ladder_table(results[NAMES[3]][0], mfu.wrn_step_flops(cfg.model, cfg.batch),
                       mfu.this_gpu()))
    if cfg.record:
        what = dict(zip(NAMES, WHAT, strict=True))
        shown = dataclasses.replace(cfg, record=True)
        for name, (rows, _) in results.items():
            path = records.write(name, shown, rows, __spec__.name, gpus=1, what=what[name])
            print(f"wrote {path}")


WHAT = ("Chapter 2: the toy network's output on a GPU against the CPU's, in FP32 and with TF32",
        "Chapter 2: host-to-GPU copy bandwidth from pageable and from pinned memory",
        "Chapter 2: one bf16 training step timed cold, by the host clock alone, and right",
        "Chapter 2: the single-GPU speed ladder, fp32 to CUDA graphs",
        "Chapter 2: the step with and without the synchronisations it does not show")


if __name__ == "__main__":
    main()
