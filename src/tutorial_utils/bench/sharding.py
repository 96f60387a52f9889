"""Chapter 6's sharding measurements: DDP against each ZeRO stage, then which fit a memory cap.

    python -m tutorial_utils.bench.sharding --nproc 2 --record

Both run :mod:`tutorial_utils.bench.workers.fsdp_step` under torchrun. The comparison runs
every mode in the same processes on the same model and data and reports, per mode, the bytes a
rank holds, the first losses, the step time, the host's queueing time and the peak memory. The
capped runs give each process ``--fit-gib`` GiB of its GPU and try to train a larger network in
each mode, each mode in processes of its own (an out-of-memory error can leave memory behind).
"""

from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..config import Config, check, opt, parse_or_exit
from ..devices import gpu_count
from ..launch import torchrun
from . import records
from .report import Column, table
from .workers.fsdp_step import FsdpStepConfig

RECORD = "06-sharding"
WORKER = "tutorial_utils.bench.workers.fsdp_step"
FIT_MODES = ("ddp", "zero1", "zero3", "zero3-blocks")


@dataclass
class ShardingConfig(Config):
    """DDP against each ZeRO stage on N processes, then which modes train under a memory cap."""

    nproc: int = opt(2, "processes (one per GPU when there are as many, else CPU processes)")
    model: str = opt("wrn-28-10", "the network every mode trains")
    batch: int = opt(128, "images per process")
    repeats: int = opt(20, "timed steps per mode")
    fit_model: str = opt("wrn-40-20", "the larger network of the capped runs")
    fit_batch: int = opt(8, "its images per process")
    fit_gib: float = opt(3.0, "GPU memory each process may use in the capped runs (GiB)")
    record: bool = opt(False, f"write the result as the record {RECORD} (book/data)")

    def __post_init__(self) -> None:
        check((self.nproc >= 2, f"--nproc must be >= 2: sharding needs several processes, "
               f"got {self.nproc}"))
        FsdpStepConfig(model=self.model, batch=self.batch, repeats=self.repeats)  # its rules
        FsdpStepConfig(model=self.fit_model, batch=self.fit_batch, fit_gib=self.fit_gib,
                       modes=("ddp",))

    @property
    def device(self) -> str:
        return "cuda" if gpu_count() >= self.nproc else "cpu"


def _launch(worker: FsdpStepConfig, nproc: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        worker = dataclasses.replace(worker, out=Path(tmp) / "fsdp.jsonl")
        return torchrun(WORKER, worker.to_argv(), nproc=nproc, timeout_s=900,
                        metrics_file=worker.out, echo=False).metrics


def run(cfg: ShardingConfig) -> list[dict]:
    """Every mode side by side, then each mode under the cap (GPUs only): the worker's lines."""
    modes = _launch(FsdpStepConfig(model=cfg.model, batch=cfg.batch, repeats=cfg.repeats,
                                   device=cfg.device), cfg.nproc)
    rows = [r | {"kind": "modes"} for r in modes]
    if cfg.device == "cuda":
        for mode in FIT_MODES:
            (fit,) = _launch(FsdpStepConfig(model=cfg.fit_model, batch=cfg.fit_batch,
                                            modes=(mode,), fit_gib=cfg.fit_gib, device="cuda"),
                             cfg.nproc)
            rows.append(fit | {"kind": "fit"})
    return rows


def measured(cfg: ShardingConfig) -> tuple[list[dict], records.Source]:
    """Chapter 6's rows: its record where there is one, else measured here; and where from."""
    return records.read_or_measure(RECORD, lambda: run(cfg), cfg)


COLUMNS = (Column("mode", "", width=13, left=True), Column("params", "params MB", ".1f"),
           Column("grads", "grads MB", ".1f", 9), Column("optimizer", "optim MB", ".1f", 9),
           Column("peak_gib", "peak GiB", ".2f", 9), Column("step_ms", "step ms", ".1f", 8),
           Column("host_ms", "host ms", ".1f", 8),
           Column("losses", "  losses", width=2, left=True, missing=""))


def modes_table(rows: list[dict]) -> str:
    """Per mode: the state a rank holds (MB), the peak memory, the step and host times."""
    return table([r | {k: r[k] / 1e6 for k in ("params", "grads", "optimizer")}
                  | {"losses": "  " + " ".join(f"{v:.4f}" for v in r["losses"])}
                  for r in rows if r["kind"] == "modes"], COLUMNS)


def fit_lines(rows: list[dict]) -> list[str]:
    """One line per capped mode: trained (with its state and peak) or ran out of memory."""
    out = []
    for r in (r for r in rows if r["kind"] == "fit"):
        state_gib = (r["params"] + r["grads"] + r["optimizer"]) / 2**30 if r["fits"] else 0
        out.append(f"{r['mode']:<13}" + (f"trains: state {state_gib:.2f} GiB per GPU, peak "
                                          f"{r['peak_gib']:.2f} GiB" if r["fits"] else
                                          f"out of memory under the {r['fit_gib']:g} GiB cap"))
    return out


def summary(rows: list[dict]) -> dict[str, float]:
    """Chapter 6's glue: each mode's state and step time against DDP's, and the losses' spread."""
    modes = {r["mode"]: r for r in rows if r["kind"] == "modes"}
    ddp = modes["ddp"]
    out = {"host_ddp": ddp["host_ms"] / ddp["step_ms"],
           "loss_diff": max(abs(a - b) for r in modes.values()
                            for a, b in zip(ddp["losses"], r["losses"], strict=True))}
    for name, r in modes.items():
        key = name.replace("-", "_")
        out |= {f"state_{key}": (r["params"] + r["grads"] + r["optimizer"]) / 1e6,
                f"slowdown_{key}": r["step_ms"] / ddp["step_ms"],
                f"peak_{key}": r.get("peak_gib", float("nan"))}
    return out


def main(argv: list[str] | None = None) -> None:
    cfg = parse_or_exit(ShardingConfig, argv, __spec__.name)
    rows = run(cfg)
    print(modes_table(rows), *fit_lines(rows), sep="\n")
    if cfg.record:
        print(f"wrote {records.write(RECORD, cfg, rows, __spec__.name, [WORKER])}")


if __name__ == "__main__":
    main()
