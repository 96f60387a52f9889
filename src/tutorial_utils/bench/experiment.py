"""Chapter 5's training runs: the same recipe on 1..N GPUs, launched, summarised and compared.

Each run is ``python -m tutorial_utils.train`` under ``torchrun`` (one process per GPU, or per
CPU core without GPUs), configured by a :class:`~tutorial_utils.train.TrainConfig`; the
per-epoch records it writes are read back. Speed is judged the way the field does
(DAWNBench, MLPerf): the training time to reach a target test accuracy.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from .launch import read_metrics, torchrun
from .report import Column, legend_outside, table
from .train import REFERENCE_BATCH, TrainConfig


@dataclass
class TrainingRun:
    processes: int
    label: str
    epochs: list[dict]  # the "epoch" records of metrics.jsonl
    start: dict  # its first "start" record: configuration, batches, data, stamp
    resumes: list[dict] = dataclasses.field(default_factory=list)  # later attempts' "start"

    @classmethod
    def from_records(cls, records: list[dict], label: str) -> TrainingRun:
        """A run from the JSON lines of its metrics.jsonl, over all its attempts."""
        starts = [r for r in records if r["event"] == "start"]
        if not starts:
            raise ValueError(f"{label}: no start record: not a training run's metrics")
        return cls(starts[0]["world_size"], label,
                   [r for r in records if r["event"] == "epoch"], starts[0], starts[1:])

    @property
    def train_s(self) -> float:
        """Seconds spent in training epochs (compilation, evaluation and start-up excluded)."""
        return sum(e["epoch_time_s"] for e in self.epochs)

    @property
    def steady_epoch_s(self) -> float:
        """Median epoch time after the first (which includes cuDNN autotuning/compilation)."""
        later = [e["epoch_time_s"] for e in self.epochs[1:]] or [self.epochs[0]["epoch_time_s"]]
        return statistics.median(later)

    @property
    def final_acc(self) -> float:
        return self.epochs[-1]["test_acc"]

    @property
    def compile_s(self) -> float:
        """Compilation and graph capture before the clock started (every attempt's)."""
        return sum(s.get("compile_warmup_s", 0.0) for s in [self.start, *self.resumes])


@dataclass(frozen=True)
class Plan:
    """Where a chapter's runs go on this machine, and what it cannot run here."""

    device: str  # "cuda" or "cpu"
    profile: str  # the size profile the runs use
    counts: list[int]  # process counts to compare, 1 first
    note: str  # what the machine leaves out, for the first cell's output

    @property
    def units(self) -> tuple[str, str]:
        return ("GPU", "GPUs") if self.device == "cuda" else ("CPU process", "CPU processes")


def plan(n_gpus: int, profile: str) -> Plan:
    """One GPU runs the single-GPU rows on the GPU at ``profile``; without a GPU, two CPU
    processes run everything at the smoke size (mechanics, not numbers)."""
    if n_gpus == 0:
        return Plan("cpu", "smoke", [1, 2], "no GPU: CPU processes at the smoke size")
    if n_gpus == 1:
        return Plan("cuda", profile, [1], "one GPU: the multi-GPU rows need 2 GPUs and are "
                    "left out")
    return Plan("cuda", profile, [1] + [n for n in (2, 4, 8) if n <= n_gpus], "")


def train(processes: int, cfg: TrainConfig, label: str = "", timeout_s: float = 1800,
          echo: bool = False) -> TrainingRun:
    """Run the training entry point with ``cfg`` in ``processes`` processes; its records."""
    result = torchrun("tutorial_utils.train", cfg.to_argv(), nproc=processes,
                      timeout_s=timeout_s, metrics_file=cfg.out / "metrics.jsonl", echo=echo)
    return TrainingRun.from_records(result.metrics, label or f"{processes} process(es)")


def load_run(path: Path, label: str = "") -> TrainingRun:
    """A run from a stored metrics.jsonl (one made earlier, in one attempt or several)."""
    return TrainingRun.from_records(read_metrics(path), label or path.parent.name)


def time_to_accuracy(run: TrainingRun, target: float) -> float:
    """Training seconds until the end of the first epoch whose test accuracy reached
    ``target`` (a fraction), or NaN if it never did. Within one run: a schedule's accuracy at
    epoch k of n is not that of a k-epoch schedule (:func:`shortest_schedule`)."""
    return next((e["train_time_s"] for e in run.epochs if e["test_acc"] >= target), math.nan)


def shortest_schedule(runs: list[TrainingRun], target: float) -> TrainingRun | None:
    """Of runs with different epoch counts, the one reaching ``target`` at its end in the least
    training time: time to accuracy as a schedule decides it, not a point on a longer one."""
    done = [r for r in runs if r.final_acc >= target]
    return min(done, key=lambda r: r.train_s, default=None)


def with_batch(cfg: TrainConfig, batch: int, rule: str = "linear") -> TrainConfig:
    """``cfg`` at another global batch, its learning rate scaled by ``rule``.

    "linear" keeps ``cfg.lr`` (train.py already multiplies it by batch / 128: Goyal et al.);
    "sqrt" scales the peak by the square root of batch / 128 instead.
    """
    lr = cfg.lr if rule == "linear" else cfg.lr * math.sqrt(REFERENCE_BATCH / batch)
    return dataclasses.replace(cfg, batch=batch, lr=lr, out=cfg.out.with_name(
        f"{cfg.out.name}-b{batch}-{rule}"))


def schedule_sweep(cfg: TrainConfig, epochs: list[int], processes: int = 1) -> list[TrainingRun]:
    """The same recipe trained for each number of ``epochs`` (its schedule stretched to fit)."""
    return [train(processes, dataclasses.replace(cfg, epochs=n, out=cfg.out.with_name(
        f"{cfg.out.name}-{n}ep")), label=f"{n} epochs") for n in epochs]


def targets_table(runs: list[TrainingRun], targets: tuple[float, ...]) -> tuple[str, dict]:
    """For each target: the shortest schedule reaching it at its end, with its training time
    and compilation; a text table and a flat summary (``tta_<pct>_s``, ``tta_<pct>_epochs``)."""
    rows, summary = [], {}
    for t in targets:
        best = shortest_schedule(runs, t)
        key = f"tta_{round(t * 1000)}"  # 0.91 -> tta_910
        rows.append({"target": f"{t:.1%}", "run": best.label if best else "not reached",
                     "train": best.train_s if best else math.nan,
                     "compile": best.compile_s if best else math.nan,
                     "acc": best.final_acc if best else math.nan})
        status = (f"{rows[-1]['train']:.1f} s, the {best.label} schedule" if best
                  else "not reached by any schedule tried")
        summary |= {f"{key}_s": rows[-1]["train"], f"{key}_compile_s": rows[-1]["compile"],
                    f"{key}_epochs": len(best.epochs) if best else math.nan,
                    f"{key}_status": status}
    cols = (Column("target", "target", width=8, left=True), Column("run", "shortest run", width=14,
            left=True), Column("train", "train s", ".1f"), Column("compile", "compile s", ".1f"),
            Column("acc", "final acc", ".2%", 11))
    return table(rows, cols), summary


COLUMNS = (Column("label", "run", width=32, left=True), Column("batch", "batch/proc", "d", 11),
           Column("first", "epoch 1 s", ".2f"), Column("later", "later s", ".2f", 9),
           Column("train", "train s", ".1f", 9), Column("speedup", "speed-up", ".2f", 10),
           Column("acc", "test acc", ".2%"))


def scaling_summary(runs: list[TrainingRun]) -> dict[str, float | int | str]:
    """Chapter 5's glue for the post's recipe on 1..N processes (NaN without a second run)."""
    one, multi = runs[0], runs[1:]
    top = multi[-1] if multi else None
    nan = math.nan
    accs = [r.final_acc for r in runs]
    return {"data_name": one.start["data"], "epochs": len(one.epochs), "t_1": one.train_s,
            "acc_1": one.final_acc * 100, "first_epoch_1": one.epochs[0]["epoch_time_s"],
            "steady_1": one.steady_epoch_s, "n_max": top.processes if top else 1,
            "t_max": top.train_s if top else nan,
            "x_max": one.train_s / top.train_s if top else nan,
            "steady_x_max": one.steady_epoch_s / top.steady_epoch_s if top else nan,
            "acc_max": top.final_acc * 100 if top else nan,
            "x_2": one.train_s / multi[0].train_s if multi else nan,
            "acc_spread": (max(accs) - min(accs)) * 100}


def runs_table(runs: list[TrainingRun], reference: TrainingRun) -> str:
    """One line per run: batch, epoch times, training time, speed-up over ``reference``."""
    rows = [{"label": r.label, "batch": r.start["per_gpu_batch"],
             "first": r.epochs[0]["epoch_time_s"], "later": r.steady_epoch_s,
             "train": r.train_s, "speedup": reference.train_s / r.train_s,
             "acc": r.final_acc} for r in runs]
    return table(rows, COLUMNS)


def plot_curves(runs: list[TrainingRun], title: str, targets: tuple[float, ...] = ()):
    """Test accuracy against epoch and against training time, one line per run."""
    import matplotlib.pyplot as plt

    fig, (by_epoch, by_time) = plt.subplots(1, 2, figsize=(9, 3.4), sharey=True)
    for r in runs:
        acc = [100 * e["test_acc"] for e in r.epochs]
        by_epoch.plot([e["epoch"] for e in r.epochs], acc, "o-", ms=3, label=r.label)
        by_time.plot([e["train_time_s"] for e in r.epochs], acc, "o-", ms=3, label=r.label)
    for t in targets:
        by_time.axhline(100 * t, color="grey", lw=0.8, ls=":")
    by_epoch.set_xlabel("epoch")
    by_time.set_xlabel("training time (s, compilation excluded)")
    by_epoch.set_ylabel("test accuracy (%)")
    legend_outside(by_time)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def steps_per_run(images: int, batch: int, epochs: int) -> int:
    """Optimizer steps of a run that drops the last, incomplete batch of every epoch."""
    return images // batch * epochs


def epoch_seconds(step_ms: float, global_batch: int, images: int = 50_000) -> float:
    """Exercise (chapter 5): an epoch's training time predicted from one step's time."""
    return steps_per_run(images, global_batch, 1) * step_ms / 1e3


def wall_clock_speedup(reference_s: float, train_s: float, setup_s: float) -> float:
    """Exercise (chapter 5): a speed-up whose clock also counts the faster run's set-up."""
    return reference_s / (train_s + setup_s)
