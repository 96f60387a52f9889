"""How far apart should two strategies' loss curves be? The GPT under each, against one process.

    python -m tutorial_utils.bench.numerics --steps 200

The same GPT, seed and global batches train for ``--steps`` steps on one process, then under
DDP (2 processes), FSDP2 (2), HSDP (4, 2 x 2), tensor parallelism (2) and FSDP2 x TP (4,
2 x 2), in two launches of :mod:`tutorial_utils.workers.numerics` on CPU processes (gloo),
in fp32 on one thread each, so that every run is repeatable bit for bit. A correct strategy
does the same arithmetic in another order: its losses differ from one process's by a few
roundings. Then DDP with a planted bug (the worker's ``--bugs``: no all-reduce, a wrong loss
scale, a rank whose last micro-batch misses the all-reduce) shows what a mistake does: a
difference orders of magnitude larger. :func:`table`, :func:`figure`
and :func:`summary` put the two side by side.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import Config, check, opt, parse_or_exit
from ..launch import run_worker
from ..workers.numerics import Bug, NumericsConfig, NumericsRow
from .report import Column, legend_outside
from .report import table as text_table

WORKER = "tutorial_utils.workers.numerics"
BUGS: tuple[Bug, ...] = ("no-allreduce", "loss-scale", "skip-last-microbatch")


@dataclass
class NumericsBenchConfig(Config):
    """The GPT under every strategy and every planted bug: its loss against one process's."""

    steps: int = opt(200, "optimizer steps per run")
    bugs: bool = opt(True, "also the planted bugs (DDP on 2 processes)")

    def __post_init__(self) -> None:
        check((self.steps >= 1, f"--steps must be >= 1, got {self.steps}"))


def run(cfg: NumericsBenchConfig | None = None) -> list[NumericsRow]:
    """Two launches: one process, DDP, FSDP2, TP 2 and the bugs on 2 processes, then HSDP and
    FSDP2 x TP on 4 (2 x 2); each launch trains the one-process reference first."""
    cfg = cfg or NumericsBenchConfig()
    two = NumericsConfig(steps=cfg.steps, layouts=("one", "ddp", "fsdp2", "tp"),
                         bugs=BUGS if cfg.bugs else ())
    four = NumericsConfig(steps=cfg.steps, layouts=("hsdp", "fsdp2-tp"))
    rows = run_worker(WORKER, two, nproc=2, timeout_s=1200, row_type=NumericsRow)
    rows += run_worker(WORKER, four, nproc=4, timeout_s=1200, row_type=NumericsRow)
    correct, bugs = [r for r in rows if r.bug == "none"], [r for r in rows if r.bug != "none"]
    return correct + bugs


def differences(row: NumericsRow, one: NumericsRow) -> list[float]:
    """|loss - one process's loss| at each step."""
    return [abs(a - b) for a, b in zip(row.losses, one.losses, strict=True)]


def _one(rows: list[NumericsRow]) -> NumericsRow:
    return next(r for r in rows if r.world_size == 1)


def _view(row: NumericsRow, one: NumericsRow) -> dict:
    diff = differences(row, one)
    worst = max(diff)
    return {"run": row.run, "nproc": row.world_size, "loss_diff": worst,
            "at_step": diff.index(worst) + 1 if worst else None,
            "final_loss": row.losses[-1], "weight_diff": row.weight_diff,
            "seconds": row.seconds}


COLUMNS = (Column("run", "run", width=26, left=True), Column("nproc", "procs", "d", 6),
           Column("loss_diff", "max |loss diff|", ".1e", 16),
           Column("at_step", "at step", "d", 8), Column("final_loss", "final loss", ".4f", 11),
           Column("weight_diff", "max |weight diff|", ".1e", 18),
           Column("seconds", "time s", ".1f", 8))


def table(rows: list[NumericsRow]) -> str:
    """Per run: the largest |loss - one process's| over the steps (and where), the final
    loss, the largest difference of a final weight to one process's, the steps' time."""
    one = _one(rows)
    return text_table([_view(r, one) for r in rows], COLUMNS)


def figure(rows: list[NumericsRow]):
    """Left: every loss curve, overlaid. Right: |loss - one process's| per step, log scale:
    the correct strategies as points (none where the losses are equal), the planted bugs as
    dashed lines, and the spacing of fp32 numbers near the final loss (one rounding)."""
    import matplotlib.pyplot as plt
    import numpy as np

    one = _one(rows)
    fig, (curves, diffs) = plt.subplots(1, 2, figsize=(10, 3.6))
    steps = np.arange(1, len(one.losses) + 1)
    for r in rows:
        bug = r.bug != "none"
        line = curves.plot(steps, r.losses, "--" if bug else "-", lw=1, label=r.run)[0]
        if r is not one:
            d = np.array(differences(r, one))
            shown = d > 0  # an exact zero has no place on a log scale
            diffs.plot(steps[shown], d[shown], "--" if bug else ".", lw=1, ms=3,
                       color=line.get_color(), label=r.run)
    rounding = float(np.spacing(np.float32(one.losses[-1])))
    diffs.axhline(rounding, color="grey", lw=0.8, ls=":", label="one fp32 rounding")
    curves.set(xlabel="step", ylabel="training loss (nats per byte)")
    diffs.set(xlabel="step", yscale="log", ylabel="|loss - one process's loss|")
    legend_outside(diffs)
    fig.suptitle("The GPT on CPU processes, fp32: each strategy and each planted bug against "
                 "one process (no point: equal)", fontsize=9)
    fig.tight_layout()
    return fig


def summary(rows: list[NumericsRow]) -> dict[str, float | str]:
    """The glue: the largest loss difference of a correct strategy (and which), the smallest
    of a planted bug (and which), their ratio; each run's largest difference by its name."""
    one = _one(rows)
    worst = {r.run: max(differences(r, one)) for r in rows if r is not one}
    correct = {k: v for k, v in worst.items() if not k.startswith("bug")}
    bugs = {k: v for k, v in worst.items() if k.startswith("bug")}
    out: dict[str, float | str] = {"steps": len(one.losses)}
    out |= {"diff_" + k.lower().replace("bug: ", "bug_").replace(" ", "_").replace("-", "_"): v
            for k, v in worst.items()}
    if correct:
        top = max(correct, key=correct.get)
        out |= {"correct_max": correct[top], "correct_max_run": top}
    if bugs:
        low = min(bugs, key=bugs.get)
        out |= {"bug_min": bugs[low], "bug_min_run": low}
    if correct and bugs:
        out["ratio"] = bugs[low] / correct[top] if correct[top] else math.inf
    return out


def main(argv: list[str] | None = None) -> None:
    cfg = parse_or_exit(NumericsBenchConfig, argv, __spec__.name)
    rows = run(cfg)
    print(table(rows))
    s = summary(rows)
    if "ratio" in s:
        print(f"\nthe smallest bug ({s['bug_min_run']}) is {s['ratio']:.0f} x the largest "
              f"difference of a correct strategy ({s['correct_max_run']})")


if __name__ == "__main__":
    main()
