"""Chapter 5b's DDP knobs: what each of DistributedDataParallel's settings does to one step.

    python -m tutorial_utils.bench.ddp_knobs --nproc 1 --record   # one GPU: host work, memory
    python -m tutorial_utils.bench.ddp_knobs --nproc 2 --record   # two GPUs: with the traffic

One launch of :mod:`tutorial_utils.bench.workers.ddp_knobs` measures every setting in the same
processes: DDP's defaults, ``bucket_cap_mb`` over a sweep, ``gradient_as_bucket_view``,
``static_graph``, ``broadcast_buffers=False``, the three flags together, and the three ways
``torch.compile`` meets DDP (a graph per bucket, one graph, compiled autograd). A group of one
process measures what the settings cost the host and the memory, with nothing to send; two GPUs
add the traffic, and whether backward hides it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..config import Config, check, check_gpus, opt, parse_or_exit
from ..devices import gpu_count
from ..launch import run_worker
from . import mfu, records
from .report import Column, table
from .workers.ddp_knobs import KnobsRow, KnobsStepConfig

WORKER = "tutorial_utils.bench.workers.ddp_knobs"
# each setting's name in the chapter's glue ("defaults_ms", "view_x", "ca_graphs", ...)
KEYS = {"defaults": "defaults", "gradient_as_bucket_view": "view", "static_graph": "static",
        "broadcast_buffers=False": "nobcast", "all three": "three",
        "compiled, a graph per bucket": "split", "compiled, one graph": "onegraph",
        "compiled autograd": "ca"}


def record_name(nproc: int) -> str:
    """The record of a run on ``nproc`` GPUs."""
    return f"05b-ddp-knobs-{nproc}gpu"


def what(nproc: int) -> str:
    return ("Chapter 5b: DDP's settings one at a time, "
            + ("as a group of one process on one GPU" if nproc == 1 else f"on {nproc} GPUs"))


@dataclass
class KnobsConfig(Config):
    """DDP's knobs, one setting at a time, on N processes: what each does to one step."""

    nproc: int = opt(2, "processes (one per GPU when there are as many, else CPU processes)")
    model: str = opt("wrn-28-10", "the network")
    batch: int = opt(128, "images per process")
    buckets: tuple[float, ...] = opt((1, 5, 25, 100, 200), "bucket_cap_mb values (MiB)")
    compiled: bool = opt(True, "also the three ways torch.compile meets DDP")
    repeats: int = opt(20, "timed steps per setting")
    record: bool = opt(False, "write the result as the record 05b-ddp-knobs-<nproc>gpu")

    def __post_init__(self) -> None:
        check((self.nproc >= 1, f"--nproc must be >= 1, got {self.nproc}"))
        self.worker()  # the worker's rules, checked before any launch

    @property
    def device(self) -> str:
        return "cuda" if gpu_count() >= self.nproc else "cpu"

    def worker(self) -> KnobsStepConfig:
        return KnobsStepConfig(model=self.model, batch=self.batch, buckets=self.buckets,
                               compiled=self.compiled, repeats=self.repeats)


def run(cfg: KnobsConfig, device: str | None = None) -> list[KnobsRow]:
    """Every setting, side by side in one launch of ``cfg.nproc`` processes (on ``device``,
    by default GPUs where there are enough)."""
    worker = dataclasses.replace(cfg.worker(), device=device or cfg.device)
    return run_worker(WORKER, worker, nproc=cfg.nproc, timeout_s=1200, row_type=KnobsRow)


def measured(cfg: KnobsConfig) -> tuple[list[KnobsRow], records.Source]:
    """The rows for ``cfg.nproc`` GPUs: the record's; this machine's with TUTORIAL_MEASURE=1;
    without a record, ``cfg.nproc`` CPU processes at ``cfg``'s size."""
    return records.measured(
        record_name(cfg.nproc), lambda: run(cfg, "cuda"), gpus=cfg.nproc, cfg=cfg,
        row_type=KnobsRow, stand_in=lambda: run(cfg, "cpu"),
        compare=records.Compare(("setting",), "step_ms", "setting: step ms"))


def _view(r: KnobsRow, defaults: KnobsRow) -> dict:
    """A row as the tables show it (a setting this torch could not run says why)."""
    row = dataclasses.asdict(r)
    if r.failed:
        return row | {"in_graphs": f"failed: {r.failed}"[:60]}
    own = r.grad_storages == r.grad_tensors  # else views into DDP's bucket memory
    in_graphs = f"{r.graphs} ({r.all_reduces_in_graphs} all-reduces)" if r.compiled else None
    return row | {"gradients": "  " + ("own tensors" if own else "in buckets"),
                  "in_graphs": in_graphs, "vs": defaults.step_ms / r.step_ms}


WHAT_COLUMNS = (Column("setting", "setting", width=30, left=True),
                Column("all_reduces", "all-reduces", ".0f", 12),
                Column("broadcasts", "broadcasts", ".0f", 11),
                Column("gradients", "  gradients", width=15, left=True),
                Column("in_graphs", "graphs compiled", width=24, left=True, missing=""))
COST_COLUMNS = (Column("setting", "setting", width=30, left=True),
                Column("step_ms", "step ms", ".2f", 9), Column("host_ms", "host ms", ".2f", 9),
                Column("exposed_ms", "comm alone ms", ".2f", 14), mfu.COLUMN,
                Column("peak_gib", "peak GiB", ".2f", 9),
                Column("vs", "vs defaults", ".2f", 12, unit="x"))


def what_table(rows: list[KnobsRow]) -> str:
    """Per setting, what runs in one step: collectives launched (per step), where the
    gradients live, and for compiled settings the graphs and the all-reduces inside them."""
    return table([_view(r, rows[0]) for r in rows], WHAT_COLUMNS)


def row_mfu(r: KnobsRow, gpu: str | None) -> float | None:
    """The MFU of a setting's step on its ``world_size`` GPUs named ``gpu`` (None on CPUs)."""
    if not r.device.startswith("cuda") or not r.images_per_s:
        return None
    return mfu.wrn_images(r.images_per_s, r.model, gpu, r.world_size)


def cost_table(rows: list[KnobsRow], gpu: str | None = None) -> str:
    """Per setting: step and host times, communication with no compute beside it, MFU on the
    GPUs named ``gpu``, peak memory, and the defaults' step time over this one's (above 1:
    faster); then what MFU divides by."""
    lines = table([_view(r, rows[0]) | {"mfu": row_mfu(r, gpu)} for r in rows], COST_COLUMNS)
    if not rows[0].model:
        return lines
    on_gpu = gpu if rows[0].device.startswith("cuda") else None
    return lines + "\n" + mfu.note(on_gpu, mfu.wrn_flops_text(rows[0].model,
                                                               [rows[0].per_gpu_batch]))


def key(setting: str) -> str:
    """The glue name of a setting: ``KEYS``, or ``b<MiB>`` for ``bucket_cap_mb=<MiB>``."""
    if setting.startswith("bucket_cap_mb="):
        return "b" + setting.removeprefix("bucket_cap_mb=").replace(".", "_")
    return KEYS[setting]


def _or_nan(value) -> float:
    return math.nan if value is None else value


def summary(rows: list[KnobsRow], gpu: str | None = None) -> dict[str, float | str]:
    """The chapter's glue: per setting its step time, its speed-up over the defaults, its MFU
    (%, on the GPUs named ``gpu``), its collectives; the fastest bucket size; the memory the
    bucket view saved; the graphs. A setting that could not run has NaN numbers and its error
    as ``<key>_failed``."""
    defaults, n = rows[0], _or_nan
    out: dict[str, float | str] = {"world_size": defaults.world_size,
                                   "grad_mib": n(defaults.grad_mib)}
    for r in rows:
        k = key(r.setting)
        out |= {f"{k}_ms": n(r.step_ms), f"{k}_x": defaults.step_ms / n(r.step_ms),
                f"{k}_reduces": n(r.all_reduces), f"{k}_bcasts": n(r.broadcasts),
                f"{k}_peak": n(r.peak_gib), f"{k}_failed": r.failed or "",
                f"{k}_mfu": mfu.percent(row_mfu(r, gpu))}
        if r.compiled:
            out |= {f"{k}_graphs": n(r.graphs), f"{k}_in_graphs": n(r.all_reduces_in_graphs)}
    sweep = [r for r in rows if r.setting.startswith("bucket_cap_mb=")]
    fastest = min(sweep, key=lambda r: r.step_ms)
    view = next(r for r in rows if r.setting == "gradient_as_bucket_view")
    eager = [r for r in rows if not r.compiled and r.losses]  # losses not kept: NaN
    return out | {
        "best_bucket": fastest.setting.removeprefix("bucket_cap_mb="),
        "best_bucket_x": defaults.step_ms / fastest.step_ms,
        "view_saved_gib": n(defaults.peak_gib) - n(view.peak_gib),
        "loss_diff": max((abs(a - b) for r in eager for a, b in
                          zip(defaults.losses, r.losses, strict=True)), default=math.nan)}


def _gpus_for_a_record(cfg: KnobsConfig) -> None:
    if cfg.record:  # a record names its GPUs: never CPU processes in their place
        check_gpus(cfg.nproc, "--nproc", "leave out --record to time CPU processes")


def main(argv: list[str] | None = None) -> None:
    cfg = parse_or_exit(KnobsConfig, argv, __spec__.name, _gpus_for_a_record)
    rows = run(cfg)
    print(what_table(rows), cost_table(rows, mfu.this_gpu()), sep="\n\n")
    if cfg.record:
        path = records.write(record_name(cfg.nproc), cfg, rows, __spec__.name, [WORKER],
                             gpus=cfg.nproc, what=what(cfg.nproc))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
