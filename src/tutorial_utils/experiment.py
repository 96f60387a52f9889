"""Chapter 5's training runs: the same recipe on 1..N GPUs, launched and summarised.

Each run is ``python -m tutorial_utils.train`` under ``torchrun`` (one process per GPU, or per
CPU core without GPUs); the per-epoch records it writes are read back and compared.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .launch import torchrun


@dataclass
class TrainingRun:
    processes: int
    label: str
    epochs: list[dict]  # the "epoch" records of metrics.jsonl
    start: dict  # its "start" record: configuration, batches, data, stamp

    @property
    def train_s(self) -> float:
        """Seconds spent in training epochs (evaluation and start-up excluded)."""
        return sum(e["epoch_time_s"] for e in self.epochs)

    @property
    def steady_epoch_s(self) -> float:
        """Median epoch time after the first (which includes cuDNN autotuning/compilation)."""
        later = [e["epoch_time_s"] for e in self.epochs[1:]] or [self.epochs[0]["epoch_time_s"]]
        return statistics.median(later)

    @property
    def final_acc(self) -> float:
        return self.epochs[-1]["test_acc"]


def train(processes: int, args: Sequence[str], out: Path, label: str = "",
          timeout_s: float = 1800, echo: bool = False) -> TrainingRun:
    """Run the training entry point in ``processes`` processes; return its records."""
    metrics = out / "metrics.jsonl"
    result = torchrun("tutorial_utils.train", [*args, "--out", str(out)], nproc=processes,
                      timeout_s=timeout_s, metrics_file=metrics, echo=echo)
    start = next(r for r in result.metrics if r["event"] == "start")
    epochs = [r for r in result.metrics if r["event"] == "epoch"]
    return TrainingRun(processes, label or f"{processes} process(es)", epochs, start)


def table(runs: list[TrainingRun], reference: TrainingRun) -> str:
    lines = [f"{'run':<30}{'batch/proc':>11}{'epoch 1 s':>10}{'later s':>9}{'train s':>9}"
             f"{'speed-up':>10}{'test acc':>10}"]
    for r in runs:
        lines.append(f"{r.label:<30}{r.start['per_gpu_batch']:>11}"
                     f"{r.epochs[0]['epoch_time_s']:>10.2f}{r.steady_epoch_s:>9.2f}"
                     f"{r.train_s:>9.1f}{reference.train_s / r.train_s:>9.2f}x{r.final_acc:>10.2%}")
    return "\n".join(lines)


def plot_curves(runs: list[TrainingRun], title: str):
    """Test accuracy against epoch and against training time, one line per run."""
    import matplotlib.pyplot as plt

    fig, (by_epoch, by_time) = plt.subplots(1, 2, figsize=(9, 3.4), sharey=True)
    for r in runs:
        acc = [100 * e["test_acc"] for e in r.epochs]
        seconds, total = [], 0.0
        for e in r.epochs:
            total += e["epoch_time_s"]
            seconds.append(total)
        by_epoch.plot([e["epoch"] for e in r.epochs], acc, "o-", ms=3, label=r.label)
        by_time.plot(seconds, acc, "o-", ms=3, label=r.label)
    by_epoch.set_xlabel("epoch")
    by_time.set_xlabel("training time (s)")
    by_epoch.set_ylabel("test accuracy (%)")
    by_epoch.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig
