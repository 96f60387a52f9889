"""Chapter 8's context parallelism: equal to one process, its memory, and a GPU record.

    python -m tutorial_utils.bench.context --gpus 2 --record   # N GPUs: the record
    python -m tutorial_utils.bench.context --device cpu         # CPU processes: a small run

:func:`check_rows` runs :mod:`tutorial_utils.workers.cp_check` on N gloo processes: ring attention
(with and without zig-zag), the naive all-gather and the GPT with ring attention, each against
one process; :func:`check_table` and :func:`memory_table` set out its rows. On N GPUs,
:mod:`tutorial_utils.bench.workers.cp_step` times causal attention against the sequence length
on one GPU, with the ring by hand and with PyTorch's ``context_parallel``: the record
``08-context-parallel``, which :func:`measured` reads (a small CPU run stands in until it is
made).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from ..config import Config, check, check_gpus, opt, parse_or_exit
from ..launch import run_worker
from ..parallel.context import check_split
from ..workers.cp_check import CPCheckConfig, CPRow
from . import mfu, records
from .report import Column, table
from .workers.cp_step import CPStepConfig, CPStepRow

RECORD = "08-context-parallel"
WHAT = "Chapter 8: causal attention's time and memory against sequence length, on one GPU, " \
       "with ring attention by hand and with PyTorch's context_parallel, on N GPUs"
CHECK_WORKER = "tutorial_utils.workers.cp_check"
STEP_WORKER = "tutorial_utils.bench.workers.cp_step"


@dataclass
class ContextConfig(Config):
    """Causal attention against sequence length on N GPUs: one GPU, ring by hand, PyTorch's."""

    gpus: int = opt(2, "N >= 2 processes, one GPU each (CPU processes with --device cpu)")
    seqs: tuple[int, ...] = opt((4096, 8192, 16384, 32768, 65536),
                                "sequence lengths, a row each (multiples of 2N)")
    batch: int = opt(1, "sequences")
    heads: int = opt(16, "attention heads")
    head_dim: int = opt(128, "values per head")
    repeats: int = opt(5, "timed steps per row")
    device: Literal["auto", "cpu", "cuda"] = opt("auto", "cpu: a small run in CPU processes")
    record: bool = opt(False, f"write the rows as the record {RECORD}")

    def __post_init__(self) -> None:
        check((self.gpus >= 2, f"--gpus must be >= 2, got {self.gpus}"),
              (not (self.record and self.device == "cpu"),
               "--record measures GPUs: leave out --device cpu"),
              (min(self.batch, self.heads, self.head_dim, self.repeats, *self.seqs) >= 1,
               "--batch, --heads, --head-dim, --repeats and --seqs must be >= 1"))
        for seq in self.seqs:
            check_split(seq, self.gpus, zigzag=True)

    def step(self, device: str) -> CPStepConfig:
        return CPStepConfig(seqs=self.seqs, batch=self.batch, heads=self.heads,
                            head_dim=self.head_dim, repeats=self.repeats, device=device)


def cpu_stand_in(cfg: ContextConfig) -> CPStepConfig:
    """The CPU processes' small run: short sequences, few heads, no context_parallel."""
    return CPStepConfig(modes=("one-process", "ring"), seqs=(256, 512, 1024), heads=2,
                        head_dim=16, repeats=3, device="cpu")


def step_rows(cfg: ContextConfig, step: CPStepConfig) -> list[CPStepRow]:
    rows = run_worker(STEP_WORKER, step, nproc=cfg.gpus, timeout_s=1800)
    return [records.from_row(CPStepRow, r) for r in rows]


def measured(cfg: ContextConfig) -> tuple[list[CPStepRow], records.Source]:
    """The record's rows, this machine's with TUTORIAL_MEASURE=1 and N GPUs, or a small run
    in CPU processes while there is no record."""
    return records.measured(
        RECORD, lambda: step_rows(cfg, cfg.step("cuda")), gpus=cfg.gpus, cfg=cfg,
        row_type=CPStepRow, compare=records.Compare(("mode", "seq"), "step_ms", "mode seq: ms"),
        stand_in=lambda: step_rows(cfg, cpu_stand_in(cfg)))


def step_table(rows: list[CPStepRow], step: ContextConfig | CPStepConfig | None = None,
               gpu: str | None = None) -> str:
    """Per mode and sequence length: the step, memory, and with ``step`` (the run's sizes) the
    MFU of causal attention's model FLOPs on the ``world`` GPUs named ``gpu`` (one GPU for a
    one-process row, which computes the whole sequence on each rank; None: CPU processes,
    "-"); then what MFU divides by."""
    out = [dataclasses.asdict(r) | {"note": "  out of memory" if r.oom else "", "mfu": (
        mfu.mfu(mfu.causal_attention_flops(step.batch, step.heads, r.seq, step.head_dim),
                r.step_ms, gpu, 1 if r.mode == "one-process" else r.world)
        if step else None)} for r in rows]
    lines = table(out, (
        Column("mode", "mode", width=18, left=True), Column("world", "ranks", width=6),
        Column("seq", "seq", width=8), Column("step_ms", "fwd+bwd ms", ".2f", 12), mfu.COLUMN,
        Column("peak_mib", "peak MiB", ".1f", 10), Column("saved_mib", "kept MiB", ".2f", 10),
        Column("predicted_mib", "predicted", ".2f", 11), Column("note", "", width=16,
                                                              left=True)))
    if step is None:
        return lines
    return lines + "\n" + mfu.note(gpu, f"causal attention, batch {step.batch}, {step.heads} heads "
                                   f"of {step.head_dim}: 6 x batch x heads x seq^2 x head_dim "
                                   "FLOPs, forward + backward, over all ranks")


def check_rows(nproc: int, cfg: CPCheckConfig | None = None) -> list[CPRow]:
    """The rows of :mod:`tutorial_utils.workers.cp_check` on ``nproc`` processes."""
    rows = run_worker(CHECK_WORKER, cfg or CPCheckConfig(device="cpu"), nproc=nproc,
                      timeout_s=300)
    return [records.from_row(CPRow, r) for r in rows]


def check_table(rows: list[CPRow]) -> str:
    """How far each mode is from one process, and the chunk pairs each rank computed."""
    return table([dataclasses.asdict(r) | {"blocks": "  " + " ".join(map(str, r.blocks))}
                  for r in rows], (
        Column("mode", "mode", width=18, left=True), Column("world", "ranks", width=6),
        Column("seq", "seq", width=6), Column("out_diff", "output diff", ".1e", 12),
        Column("grad_diff", "grad diff", ".1e", 11),
        Column("blocks", "  chunk pairs per rank", width=24, left=True)))


def memory_table(rows: list[CPRow]) -> str:
    """Bytes kept for backward per rank against sequence length: the ring's prediction and
    measurement, the all-gather route's measurement, and one process with the whole sequence."""
    seqs = sorted({r.seq for r in rows})
    by = {(r.mode, r.seq): r for r in rows}
    lines = [{"seq": s, "world": next(r.world for r in rows if r.seq == s),
              "predicted": _kib(by.get(("ring-zigzag", s)), "predicted_bytes"),
              "ring": _kib(by.get(("ring-zigzag", s)), "saved_bytes"),
              "gathered": _kib(by.get(("gathered", s)), "saved_bytes"),
              "one": _kib(by.get(("ring-zigzag", s)) or by.get(("gathered", s)),
                          "one_process_bytes")} for s in seqs]
    return table(lines, (
        Column("seq", "seq", width=6), Column("world", "ranks", width=6),
        Column("predicted", "ring predicted KiB", ".1f", 19),
        Column("ring", "ring measured", ".1f", 14), Column("gathered", "all-gather", ".1f", 11),
        Column("one", "one process", ".1f", 12)))


def _kib(row: CPRow | None, field: str) -> float | None:
    value = getattr(row, field) if row is not None else None
    return None if value is None else value / 2**10


def _machine(cfg: ContextConfig) -> None:
    if cfg.device != "cpu":  # N GPUs, one process each: never CPU processes that pass for them
        check_gpus(cfg.gpus, "--gpus", "--device cpu for a small run in CPU processes",
                   fewest=2)


def main(argv: list[str] | None = None) -> None:
    cfg = parse_or_exit(ContextConfig, argv, __spec__.name, machine=_machine)
    step = cpu_stand_in(cfg) if cfg.device == "cpu" else cfg.step("cuda")
    rows = step_rows(cfg, step)
    print(step_table(rows, step, mfu.this_gpu() if step.device == "cuda" else None))
    if cfg.record:
        path = records.write(RECORD, cfg, rows, __spec__.name, [STEP_WORKER], gpus=cfg.gpus,
                             what=WHAT)
        print(f"wrote {path}")



if __name__ == "__main__":
    main()
