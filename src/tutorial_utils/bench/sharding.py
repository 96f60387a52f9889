"""Chapter 6's sharding measurements: DDP against each ZeRO stage, each at its best, then which
modes fit a memory cap.

    python -m tutorial_utils.bench.sharding --nproc 1 --record   # one GPU: host work alone
    python -m tutorial_utils.bench.sharding --nproc 2 --record   # two GPUs: with the traffic

Both run :mod:`tutorial_utils.bench.workers.fsdp_step` under torchrun, one launch per per-GPU
batch: every mode in every variant that composes with it (eager, compiled per block, compiled
whole, DDP's step as one CUDA graph), in the same processes on the same model and data. Per mode
and variant: the bytes a rank holds, the first losses, the step time, the host's queueing time
and the peak memory. One process forms a process group of one, so DDP and FSDP2 wrap the model
as on N GPUs: their host work, with nothing to send. The capped runs (two processes or more)
give each process ``--fit-gib`` GiB of its GPU and try to train a larger network in each mode,
each mode in processes of its own (an out-of-memory error can leave memory behind).
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
from .workers.fsdp_step import VARIANTS, FsdpRow, FsdpStepConfig, Variant

WORKER = "tutorial_utils.bench.workers.fsdp_step"
FIT_MODES = ("ddp", "zero1", "zero3", "zero3-blocks")
SHARDED = ("zero2", "zero3", "zero3-blocks")  # FSDP2's modes
HOST_BOUND = 0.9  # host time per step at or above this fraction of the step: the GPU waits


def record_name(nproc: int) -> str:
    """The record of a run on ``nproc`` GPUs (chapter 6 reads the one-GPU and two-GPU ones)."""
    return f"06-sharding-{nproc}gpu"


@dataclass
class ShardingConfig(Config):
    """DDP against each ZeRO stage on N processes, each at its best; which train under a cap."""

    nproc: int = opt(2, "processes (one per GPU when there are as many, else CPU processes)")
    model: str = opt("wrn-28-10", "the network every mode trains")
    batches: tuple[int, ...] = opt((128, 512), "images per process: one launch for each")
    variants: tuple[Variant, ...] = opt(VARIANTS, "how each mode runs (GPUs; CPU: eager)")
    repeats: int = opt(20, "timed steps per mode and variant")
    fit_model: str = opt("wrn-40-20", "the larger network of the capped runs")
    fit_batch: int = opt(8, "its images per process")
    fit_gib: float = opt(3.0, "GPU memory each process may use in the capped runs (GiB)")
    record: bool = opt(False, "write the result as the record 06-sharding-<nproc>gpu (book/data)")

    def __post_init__(self) -> None:
        check((self.nproc >= 1, f"--nproc must be >= 1, got {self.nproc}"),
              (bool(self.batches), "--batches needs at least one batch size"))
        for batch in self.batches:  # the worker's rules
            FsdpStepConfig(model=self.model, batch=batch, repeats=self.repeats,
                           variants=self.variants)
        FsdpStepConfig(model=self.fit_model, batch=self.fit_batch, fit_gib=self.fit_gib,
                       modes=("ddp",))

    @property
    def device(self) -> str:
        return "cuda" if gpu_count() >= self.nproc else "cpu"


def _launch(worker: FsdpStepConfig, nproc: int) -> list[FsdpRow]:
    return run_worker(WORKER, worker, nproc=nproc, row_type=FsdpRow)


def run(cfg: ShardingConfig, device: str | None = None) -> list[FsdpRow]:
    """Every mode and variant side by side at each batch, then each mode under the cap (on two
    GPUs or more): the worker's lines. ``device``: cuda or cpu (default: GPUs if enough)."""
    device = device or cfg.device
    gpus = device == "cuda"
    rows = []
    for batch in cfg.batches:
        modes = _launch(FsdpStepConfig(model=cfg.model, batch=batch, repeats=cfg.repeats,
                                       variants=cfg.variants if gpus else ("eager",),
                                       device=device), cfg.nproc)
        rows += modes
    if gpus and cfg.nproc >= 2:  # sharding over one process saves nothing
        for mode in FIT_MODES:
            (fit,) = _launch(FsdpStepConfig(model=cfg.fit_model, batch=cfg.fit_batch,
                                            modes=(mode,), fit_gib=cfg.fit_gib, device="cuda"),
                             cfg.nproc)
            rows.append(dataclasses.replace(fit, kind="fit"))
    return rows


def what(nproc: int) -> str:
    return ("Chapter 6: FSDP2's sharding modes against DDP, step time and memory, "
            + ("as a group of one process on one GPU" if nproc == 1 else f"on {nproc} GPUs"))


def measured(cfg: ShardingConfig) -> tuple[list[FsdpRow], records.Source]:
    """Chapter 6's rows for ``cfg.nproc`` GPUs: the record's; this machine's with
    TUTORIAL_MEASURE=1; without a record, ``cfg.nproc`` CPU processes at ``cfg``'s size."""
    return records.measured(
        record_name(cfg.nproc), lambda: run(cfg, "cuda"), gpus=cfg.nproc, cfg=cfg,
        stand_in=lambda: run(cfg, "cpu"), row_type=FsdpRow,
        compare=records.Compare(("mode", "variant", "per_gpu_batch"), "step_ms",
                                "mode variant batch: step ms"))


def _modes(rows: list[FsdpRow], batch: int | None = None) -> list[FsdpRow]:
    """The comparison's rows at ``batch`` (default: the first batch measured), in order."""
    modes = [r for r in rows if r.kind == "modes" and r.step_ms is not None]
    batch = modes[0].per_gpu_batch if batch is None else batch
    return [r for r in modes if r.per_gpu_batch == batch]


def batches(rows: list[FsdpRow]) -> list[int]:
    """The per-GPU batches of the comparison, in the order measured."""
    return list(dict.fromkeys(r.per_gpu_batch for r in rows if r.kind == "modes"))


STATE_COLUMNS = (Column("mode", "", width=13, left=True), Column("params", "params MB", ".1f"),
                 Column("grads", "grads MB", ".1f", 9),
                 Column("optimizer", "optim MB", ".1f", 9),
                 Column("losses", "  first losses", width=2, left=True, missing=""))


def state_table(rows: list[FsdpRow]) -> str:
    """Per mode (eager, first batch): the state a rank holds (MB) and its first losses."""
    return table([{"mode": r.mode, "params": r.params / 1e6, "grads": r.grads / 1e6,
                   "optimizer": r.optimizer / 1e6,
                   "losses": "  " + " ".join(f"{v:.4f}" for v in r.losses)}
                  for r in _modes(rows) if r.variant == "eager"], STATE_COLUMNS)


TIME_COLUMNS = (Column("mode", "", width=13, left=True), Column("variant", "variant", width=8,
                left=True), Column("step_ms", "step ms", ".2f", 9),
                Column("host_ms", "host ms", ".2f", 9), Column("images_per_s", "images/s", ".0f"),
                mfu.COLUMN, Column("peak_gib", "peak GiB", ".2f", 9),
                Column("marks", "", width=2, left=True, missing=""))


def row_mfu(row: FsdpRow, gpu: str | None) -> float | None:
    """The MFU of a row's step on its ``world_size`` GPUs named ``gpu`` (None on CPUs)."""
    if not row.device.startswith("cuda") or row.images_per_s is None:
        return None
    return mfu.wrn_images(row.images_per_s, row.model, gpu, row.world_size)


def host_bound(row: FsdpRow) -> bool:
    """Whether the host's time to queue the row's step is at least 90 % of the step."""
    return row.host_ms >= HOST_BOUND * row.step_ms


def best(rows: list[FsdpRow], modes: tuple[str, ...]) -> FsdpRow | None:
    """The fastest of ``rows`` whose mode is one of ``modes``."""
    return min((r for r in rows if r.mode in modes), key=lambda r: r.step_ms, default=None)


def time_table(rows: list[FsdpRow], batch: int, gpu: str | None = None) -> str:
    """Per mode and variant at ``batch``: step and host times, images/s, MFU on the GPUs named
    ``gpu``, peak memory; each mode's fastest variant marked "best", and "host-bound" where the
    host's time to queue a step is at least 90 % of the step. Then what MFU divides by."""
    here = _modes(rows, batch)
    fastest = {id(best(here, (m,))) for m in dict.fromkeys(r.mode for r in here)}
    out = []
    for r in here:
        marks = ["best" if id(r) in fastest else "",
                 "host-bound" if host_bound(r) else ""]
        out.append(dataclasses.asdict(r) | {"marks": "  " + ", ".join(m for m in marks if m),
                                            "mfu": row_mfu(r, gpu)})
    on_gpu = gpu if here[0].device.startswith("cuda") else None
    return table(out, TIME_COLUMNS) + "\n" + mfu.note(
        on_gpu, mfu.wrn_flops_text(here[0].model, [batch]))


def fit_lines(rows: list[FsdpRow]) -> list[str]:
    """One line per capped mode: trained (with its state and peak) or ran out of memory."""
    out = []
    for r in (r for r in rows if r.kind == "fit"):
        state_gib = r.state / 2**30 if r.fits else 0
        out.append(f"{r['mode']:<13}" + (f"trains: state {state_gib:.2f} GiB per GPU, peak "
                                          f"{r['peak_gib']:.2f} GiB" if r.fits else
                                          f"out of memory under the {r['fit_gib']:g} GiB cap"))
    return out


COMPILED = ("blocks", "model")


def compile_slower(rows: list[FsdpRow], batch: int) -> list[FsdpRow]:
    """The compiled rows at ``batch`` of the modes whose every compiled variant stepped slower
    than the mode's eager step."""
    here = _modes(rows, batch)
    eager = {r.mode: r.step_ms for r in here if r.variant == "eager"}
    compiled = [r for r in here if r.variant in COMPILED and r.mode in eager]
    slower = {m for m in eager if any(r.mode == m for r in compiled)
              and all(r.step_ms > eager[m] for r in compiled if r.mode == m)}
    return [r for r in compiled if r.mode in slower]


def summary(rows: list[FsdpRow], gpu: str | None = None) -> dict[str, float | str]:
    """Chapter 6's glue: the state per mode, the losses' spread, and at each batch DDP's and
    FSDP2's best variant, their ratio and MFU (%, on the GPUs named ``gpu``), and how much of
    DDP's eager step the host took."""
    first = {r.mode: r for r in _modes(rows) if r.variant == "eager"}
    ddp = first["ddp"]
    out: dict[str, float | str] = {
        "world_size": ddp.world_size, "mfu_gpu": mfu.short_name(gpu),
        "loss_diff": max(abs(a - b) for r in first.values()
                         for a, b in zip(ddp.losses, r.losses, strict=True))}
    for name, r in first.items():
        out[f"state_{name.replace('-', '_')}"] = r.state / 1e6
    for batch in batches(rows):
        here = _modes(rows, batch)
        eager = {r.mode: r for r in here if r.variant == "eager"}
        top_ddp, top_fsdp = best(here, ("ddp",)), best(here, SHARDED)
        slower = compile_slower(rows, batch)
        names = list(dict.fromkeys(r.mode for r in slower))
        out |= {f"compile_slower_{batch}": (", ".join(names[:-1]) + " and " + names[-1]
                                            if len(names) > 1 else "".join(names) or "none"),
                f"compile_slower_rows_{batch}": len(slower),
                f"compile_slower_host_bound_{batch}": sum(map(host_bound, slower))}
        zero3 = eager.get("zero3")
        out |= {f"host_ddp_{batch}": eager["ddp"].host_ms / eager["ddp"].step_ms,
                f"eager_ddp_{batch}": eager["ddp"].step_ms,
                f"eager_zero3_{batch}": zero3.step_ms if zero3 else math.nan,
                f"best_ddp_{batch}": top_ddp.step_ms,
                f"best_ddp_{batch}_name": top_ddp.variant,
                f"best_fsdp_{batch}": top_fsdp.step_ms if top_fsdp else math.nan,
                f"best_fsdp_{batch}_name": (f"{top_fsdp.mode}, {top_fsdp.variant}"
                                            if top_fsdp else "not measured"),
                f"fsdp_over_ddp_{batch}": (top_fsdp.step_ms / top_ddp.step_ms
                                           if top_fsdp else math.nan),
                f"best_ddp_{batch}_mfu": mfu.percent(row_mfu(top_ddp, gpu)),
                f"best_fsdp_{batch}_mfu": mfu.percent(row_mfu(top_fsdp, gpu) if top_fsdp else None)}
    return out


def _gpus_for_a_record(cfg: ShardingConfig) -> None:
    if cfg.record:  # a record names its GPUs: never CPU processes in their place
        check_gpus(cfg.nproc, "--nproc", "leave out --record to time CPU processes")


def main(argv: list[str] | None = None) -> None:
    cfg = parse_or_exit(ShardingConfig, argv, __spec__.name, _gpus_for_a_record)
    rows = run(cfg)
    print(state_table(rows))
    for batch in batches(rows):
        print(f"\n{batch} images per process:\n{time_table(rows, batch, mfu.this_gpu())}")
    print(*fit_lines(rows), sep="\n")
    if cfg.record:
        path = records.write(record_name(cfg.nproc), cfg, rows, __spec__.name, [WORKER],
                             gpus=cfg.nproc, what=what(cfg.nproc))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
