"""Training runs: the same recipe on 1..N GPUs, launched, summarised and compared.

Each run is ``python -m tutorial_utils.train`` under ``torchrun`` (one process per GPU, or per
CPU process without GPUs), configured by a :class:`~tutorial_utils.trainer.TrainConfig`; the
per-epoch records it writes are read back. Speed is judged the way the field does
(DAWNBench, MLPerf): the training time to reach a target test accuracy. The runs of chapters
5, 5d and 5e are :class:`Job` lists built by one function each (:data:`PLANS`), so that the
chapter and ``python -m tutorial_utils.bench.experiment --plan ... --record`` run the same ones.
"""

from __future__ import annotations

import dataclasses
import math
import shlex
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..config import Config, ConfigError, check, check_gpus, opt, parse_or_exit
from ..jsonl import read_jsonl
from ..launch import torchrun
from ..profiles import pick
from ..trainer import REFERENCE_BATCH, TrainConfig, saved_train_config
from . import mfu, records
from .report import Column, legend_outside, table


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
    def command(self) -> str:
        """The command line of the run, from the configuration its start record holds."""
        known = {f.name for f in dataclasses.fields(TrainConfig)}
        saved = saved_train_config(self.start["config"])
        cfg = TrainConfig(**{k: v for k, v in saved.items() if k in known})
        return Job(self.processes, cfg, self.label).command()

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
        return Plan("cuda", profile, [1], "one GPU: what needs two comes from a record of a "
                    "two-GPU run")
    return Plan("cuda", profile, [1] + [n for n in (2, 4, 8) if n <= n_gpus], "")


def train(processes: int, cfg: TrainConfig, label: str = "", timeout_s: float = 1800,
          echo: bool = False) -> TrainingRun:
    """Run the training entry point with ``cfg`` in ``processes`` processes; its records."""
    result = torchrun("tutorial_utils.train", cfg.to_argv(), nproc=processes,
                      timeout_s=timeout_s, metrics_file=cfg.out / "metrics.jsonl", echo=echo)
    return TrainingRun.from_records(result.metrics, label or f"{processes} process(es)")


def load_run(path: Path, label: str = "") -> TrainingRun:
    """A run from a stored metrics.jsonl (one made earlier, in one attempt or several)."""
    return TrainingRun.from_records(read_jsonl(path), label or path.parent.name)


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


def by_schedule(runs: list[TrainingRun]) -> list[list[TrainingRun]]:
    """The runs grouped by their epoch count (one group per schedule, its seeds), shortest
    schedule first."""
    groups: dict[int, list[TrainingRun]] = {}
    for r in runs:
        groups.setdefault(r.start["config"]["epochs"], []).append(r)
    return [groups[n] for n in sorted(groups)]


def targets_table(runs: list[TrainingRun], targets: tuple[float, ...]) -> tuple[str, dict]:
    """For each target: the shortest schedule whose seeds reach it *on average* at its end,
    with its mean training time and compilation, and its lowest seed; a text table and a flat
    summary (``tta_<pct>_s``, ``_epochs``, ``_lowest``, ``_every``, ``_status``)."""
    rows, summary = [], {}
    schedules = by_schedule(runs)
    for t in targets:
        best = next((g for g in schedules
                     if statistics.mean(r.final_acc for r in g) >= t), None)
        key = f"tta_{round(t * 1000)}"  # 0.91 -> tta_910
        row = {"target": f"{t:.1%}", "run": "not reached", "seeds": 0, "train": math.nan,
               "compile": math.nan, "acc": math.nan, "lowest": math.nan, "every": "-"}
        epochs, status = math.nan, "not reached by any schedule tried"
        if best:
            epochs, low = len(best[0].epochs), min(best, key=lambda r: r.final_acc)
            missed = [r.start["config"]["seed"] for r in best if r.final_acc < t]
            row |= {"run": f"{epochs} epochs", "seeds": len(best),
                    "train": statistics.mean(r.train_s for r in best),
                    "compile": statistics.mean(r.compile_s for r in best),
                    "acc": statistics.mean(r.final_acc for r in best), "lowest": low.final_acc,
                    "every": "yes" if not missed else "not seed " + ", ".join(map(str, missed))}
            seeds = f"mean of {len(best)} seeds" if len(best) > 1 else "one seed"
            status = f"the {epochs}-epoch schedule, {row['train']:.1f} s of training ({seeds})"
        rows.append(row)
        summary |= {f"{key}_s": row["train"], f"{key}_compile_s": row["compile"],
                    f"{key}_epochs": epochs, f"{key}_acc": row["acc"] * 100,
                    f"{key}_lowest": row["lowest"] * 100, f"{key}_every": row["every"],
                    f"{key}_status": status}
    cols = (Column("target", "target", width=8, left=True),
            Column("run", "shortest schedule", width=18, left=True),
            Column("seeds", "seeds", "d", 6),
            Column("train", "train s", ".1f"), Column("compile", "compile s", ".1f"),
            Column("acc", "mean acc", ".2%", 10), Column("lowest", "lowest", ".2%", 9),
            Column("every", "every seed", width=12))
    return table(rows, cols), summary


def batchnorm_table(runs: list[TrainingRun]) -> tuple[str, dict]:
    """Runs that differ in how many images each BatchNorm statistic sees (``--ghost-bn``): for
    each group size, the whole batch first, as on how many GPUs, the mean and lowest final
    accuracy of its seeds, the epoch time and its MFU (the seeds' mean, "-" where a run has
    none); a text table and a flat summary (``bn_<G>_acc``,
    ``_lowest``, ``_drop``, ``_epoch_s``; ``bn_whole``, ``bn_smallest``, ``bn_seeds``...)."""
    groups: dict[int, list[TrainingRun]] = {}
    for r in runs:  # the images one process normalises at once: its micro-batch, or a group
        micro = r.start["per_gpu_batch"] // r.start["config"].get("grad_accum", 1)
        groups.setdefault(r.start["config"].get("ghost_bn") or micro, []).append(r)
    whole = runs[0].start["per_gpu_batch"] // runs[0].start["config"].get("grad_accum", 1)
    if whole not in groups:
        raise ValueError(f"no run normalises over the whole {whole} images: the table compares "
                         "every group with a run without --ghost-bn")
    whole_acc = statistics.mean(r.final_acc for r in groups[whole])
    rows, summary = [], {"bn_whole": whole, "bn_whole_acc": whole_acc * 100,
                         "bn_epochs": len(runs[0].epochs),
                         "bn_seeds": min(len(g) for g in groups.values())}
    for images in sorted(groups, reverse=True):
        seeds = groups[images]
        acc = statistics.mean(r.final_acc for r in seeds)
        row = {"images": images, "gpus": whole // images, "seeds": len(seeds), "acc": acc,
               "lowest": min(r.final_acc for r in seeds), "drop": (whole_acc - acc) * 100,
               "epoch_s": statistics.mean(r.steady_epoch_s for r in seeds),
               "mfu": _mean_or_none([run_mfu(r) for r in seeds])}
        rows.append(row)
        summary |= {f"bn_{images}_acc": acc * 100, f"bn_{images}_lowest": row["lowest"] * 100,
                    f"bn_{images}_drop": row["drop"], f"bn_{images}_epoch_s": row["epoch_s"]}
    small = rows[-1]
    summary |= {"bn_smallest": small["images"], "bn_smallest_gpus": small["gpus"],
                "bn_smallest_acc": small["acc"] * 100, "bn_smallest_drop": small["drop"]}
    cols = (Column("images", "BN over", "d", 8), Column("gpus", "as on GPUs", "d", 11),
            Column("seeds", "seeds", "d", 6), Column("acc", "mean acc", ".2%", 10),
            Column("lowest", "lowest", ".2%", 9), Column("drop", "drop", ".2f", 10, unit=" pt"),
            Column("epoch_s", "epoch s", ".2f", 9), mfu.COLUMN)
    return table(rows, cols), summary


def _mean_or_none(values: list[float | None]) -> float | None:
    return None if not values or None in values else statistics.mean(values)


COLUMNS = (Column("label", "run", width=32, left=True), Column("batch", "batch/proc", "d", 11),
           Column("first", "epoch 1 s", ".2f"), Column("later", "later s", ".2f", 9),
           mfu.COLUMN, Column("train", "train s", ".1f", 9),
           Column("speedup", "speed-up", ".2f", 10), Column("acc", "test acc", ".2%"))


def run_mfu(run: TrainingRun) -> float | None:
    """MFU of a run's later epochs: their median images/s times the network's model FLOPs per
    image, over the dense bf16 peak of the GPUs its own start record names, one per process.
    None for CPU processes or a GPU without a known peak."""
    cfg = run.start["config"]
    later = [e.get("images_per_s") for e in run.epochs[1:]] or [run.epochs[0].get("images_per_s")]
    if cfg.get("device") == "cpu" or None in later:
        return None
    return mfu.wrn_images(statistics.median(later), f"wrn-{cfg['depth']}-{cfg['width']}",
                          mfu.gpu_of(run.start.get("stamp")), run.processes)


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
            "acc_spread": (max(accs) - min(accs)) * 100, "mfu_1": mfu.percent(run_mfu(one)),
            "mfu_gpu": mfu.short_name(mfu.gpu_of(one.start.get("stamp"))),
            "mfu_max": mfu.percent(run_mfu(top)) if top else nan}


def runs_table(runs: list[TrainingRun], reference: TrainingRun) -> str:
    """One line per run: batch, epoch times, the later epochs' MFU, training time, speed-up
    over ``reference``; then what MFU divides by (each run's GPU, from its start record)."""
    rows = [{"label": r.label, "batch": r.start["per_gpu_batch"],
             "first": r.epochs[0]["epoch_time_s"], "later": r.steady_epoch_s,
             "mfu": run_mfu(r), "train": r.train_s, "speedup": reference.train_s / r.train_s,
             "acc": r.final_acc} for r in runs]
    gpu = next((mfu.gpu_of(r.start.get("stamp")) for r in runs if r.start["config"].get(
        "device") != "cpu" and mfu.gpu_of(r.start.get("stamp"))), None)
    cfg = runs[0].start["config"]
    model = f"wrn-{cfg['depth']}-{cfg['width']}"
    flops = mfu.wrn_flops_text(model, [r.start["per_gpu_batch"] for r in runs])
    return table(rows, COLUMNS) + "\n" + mfu.note(gpu, flops, "MFU (of the later epochs)")


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


@dataclass
class Job:
    """One training run of a plan: how many processes, its configuration, its label."""

    processes: int
    cfg: TrainConfig
    label: str

    def command(self, width: int = 92) -> str:
        """The command line that runs it, broken with `` \\`` before ``width`` characters."""
        args = self.cfg.to_argv()
        # an option and its value stay together
        pairs = [(a, b) if b and not b.startswith("--") else (a,) for a, b in zip(
            args, [*args[1:], None], strict=True) if a.startswith("--")]
        lines = []
        line = f"torchrun --standalone --nproc_per_node={self.processes} -m tutorial_utils.train"
        for pair in pairs:
            piece = " ".join(shlex.quote(p) for p in pair)
            if len(line) + len(piece) + 3 > width:
                lines.append(line + " \\")
                line = "    "
            line += (" " if line.strip() else "") + piece
        return "\n".join([*lines, line])


def post_recipe(machine: Plan, data: str, out: Path) -> TrainConfig:
    """The Torch7 post's recipe at the size of ``machine``'s profile: 10 epochs of WRN-28-10."""
    size = pick(smoke=dict(depth=10, width=1, epochs=2), full=dict(depth=28, width=10,
                epochs=10), profile=machine.profile)
    return TrainConfig(**size, batch=128, data=data, checkpoint_every=0, seed=0,
                       device=machine.device, out=out)


def fast_recipe(machine: Plan, data: str, out: Path) -> TrainConfig:
    """Chapter 5's fast recipe on one process (batch 128), the base of chapters 5d and 5e."""
    return dataclasses.replace(post_recipe(machine, data, out), step_graph=True, crop_pad=2,
                               label_smoothing=0.1, tta=True,
                               compile=pick(smoke="none", full="default",
                                            profile=machine.profile))


def chapter5(machine: Plan, data: str) -> list[Job]:
    """The post's recipe on each of ``machine.counts``, then the fast recipe on the most
    (weak scaling: 128 images per process)."""
    units, runs, n = machine.units, Path("runs/ch05"), machine.counts[-1]
    jobs = [Job(k, post_recipe(machine, data, runs / f"strong-{k}"),
                f"{k} {units[k > 1]}, {128 // k} images each") for k in machine.counts]
    fast = dataclasses.replace(fast_recipe(machine, data, runs / f"fast-{n}"), scaling="weak")
    return jobs + [Job(n, fast, f"{n} {units[n > 1]}, fast recipe")]


def chapter5d(machine: Plan, data: str) -> list[Job]:
    """The fast recipe for several epoch counts, each schedule stretched to fit, each with
    several seeds (a target is met by their mean, and the lowest is shown)."""
    fast = fast_recipe(machine, data, Path("runs/ch05d/fast"))
    epochs = pick(smoke=[1, 2], full=[11, 14, 17], profile=machine.profile)
    seeds = pick(smoke=[0], full=[0, 1, 2], profile=machine.profile)
    return [Job(1, dataclasses.replace(fast, epochs=n, seed=seed,
                                       out=fast.out.with_name(f"fast-{n}ep-seed{seed}")),
                f"{n} epochs, seed {seed}") for n in epochs for seed in seeds]


def chapter5e(machine: Plan, data: str) -> list[Job]:
    """The fast recipe at larger global batches, the peak learning rate scaled by each rule."""
    base = fast_recipe(machine, data, Path("runs/ch05e/fast"))
    plan_ = pick(smoke=[(128, "linear"), (512, "linear"), (512, "sqrt")],
                 full=[(128, "linear"), (256, "linear"), (512, "linear"), (1024, "linear"),
                       (512, "sqrt"), (1024, "sqrt")], profile=machine.profile)
    return [Job(1, with_batch(base, b, rule), f"{b}, {rule}") for b, rule in plan_]


def chapter5e_bn(machine: Plan, data: str) -> list[Job]:
    """The fast recipe with BatchNorm over the whole batch of 128 and over groups of it
    (``--ghost-bn``): what 128 / G GPUs of G images each would see without SyncBatchNorm,
    measured on one GPU, for two seeds. A smaller network, its step recorded but not compiled,
    so that each run starts in seconds and the ten fit in one record."""
    base = dataclasses.replace(fast_recipe(machine, data, Path("runs/ch05e/bn")), compile="none",
                               **pick(smoke=dict(epochs=1, limit_per_class=100),
                                      full=dict(depth=16, width=4),
                                      profile=machine.profile))
    groups = pick(smoke=[None, 4], full=[None, 32, 8, 4, 2], profile=machine.profile)
    seeds = pick(smoke=[0], full=[0, 1], profile=machine.profile)
    return [Job(1, dataclasses.replace(base, ghost_bn=g, seed=s,
                                       out=base.out / f"bn{g or 128}-seed{s}"),
                f"{g or 128} images, seed {s}") for g in groups for s in seeds]


def chapter5_loaders(machine: Plan, data: str) -> list[Job]:
    """The post's recipe for two epochs on a fifth of the images, fed by each loader: the data
    kept on the GPU and augmented there, or a DataLoader's CPU workers."""
    size = pick(smoke=dict(depth=10, width=1), full=dict(depth=28, width=10,
                limit_per_class=1000), profile=machine.profile)
    base = dataclasses.replace(post_recipe(machine, data, Path("runs/ch05")), **size, epochs=2)
    return [Job(1, dataclasses.replace(base, loader=loader, out=base.out / f"loader-{loader}"),
                loader) for loader in ("device", "dataloader")]


def chapter5_full(machine: Plan, data: str) -> list[Job]:
    """The paper's recipe: 200 epochs of WRN-28-10 with dropout 0.3 and the step schedule, on
    one GPU, checkpointed every 5 epochs so that an interrupted job resumes."""
    size = pick(smoke=dict(depth=10, width=1, epochs=2), full=dict(depth=28, width=10,
                epochs=200), profile=machine.profile)
    cfg = TrainConfig(**size, dropout=0.3, schedule="step", warmup_epochs=0, batch=128,
                      step_graph=machine.device == "cuda", compile=pick(
                          smoke="none", full="default", profile=machine.profile),
                      checkpoint_every=5, data=data, device=machine.device,
                      out=Path("runs/wrn-28-10-200ep"), resume=True)
    return [Job(1, cfg, "WRN-28-10, 200 epochs")]


@dataclass(frozen=True)
class PlanRecord:
    """A plan's record: its name, the jobs of the plan, the GPUs they need, what it holds."""

    name: str
    jobs: Callable[[Plan, str], list[Job]]
    gpus: int
    what: str


PLANS: dict[str, PlanRecord] = {
    "05": PlanRecord("05-wrn-runs", chapter5, 2, "Chapter 5: the Torch7 post's recipe for 10 "
                     "epochs on one and on two GPUs, and the fast recipe on two"),
    "05-200ep": PlanRecord("05-wrn-200ep", chapter5_full, 1, "Chapter 5: the paper's recipe, "
                           "200 epochs of WRN-28-10, on one GPU in two jobs"),
    "05-loaders": PlanRecord("05-loaders", chapter5_loaders, 1, "Chapter 5: the post's recipe "
                             "fed by the GPU-resident loader and by a DataLoader, on one GPU"),
    "05d": PlanRecord("05d-schedules", chapter5d, 1, "Chapter 5d: the fast recipe over three "
                      "schedules and three seeds on one GPU, time to 90-92 % test accuracy"),
    "05e": PlanRecord("05e-batches", chapter5e, 1, "Chapter 5e: the fast recipe at global "
                      "batches 128 to 1,024, linear and square-root learning-rate rules, on one "
                      "GPU"),
    "05e-bn": PlanRecord("05e-ghost-bn", chapter5e_bn, 1, "Chapter 5e: BatchNorm statistics "
                         "over the whole batch and over groups of it (ghost BatchNorm), on one "
                         "GPU")}


def run_jobs(jobs: list[Job]) -> list[TrainingRun]:
    return [train(j.processes, j.cfg, j.label) for j in jobs]


def rows_of(runs: list[TrainingRun]) -> list[dict]:
    """Every record of every run, labelled, as a record of the book stores them; no machine
    paths: the data source keeps its file name only."""
    rows = []
    for r in runs:
        for line in [r.start, *r.resumes, *r.epochs]:
            if "config" in line:
                data = Path(line["config"]["data"]).name
                line = line | {"config": line["config"] | {"data": data}}
            rows.append(line | {"run": r.label})
    return rows


def from_rows(rows: list[dict]) -> list[TrainingRun]:
    """The runs that :func:`rows_of` stored, in their order."""
    labels = list(dict.fromkeys(r["run"] for r in rows))
    return [TrainingRun.from_records([r for r in rows if r["run"] == label], label)
            for label in labels]


def measured(chapter: str, machine: Plan, data: str) -> tuple[list[TrainingRun], records.Source]:
    """The runs of ``chapter``'s plan: its record's; trained on ``machine`` with
    TUTORIAL_MEASURE=1; or, with neither, trained in CPU processes at the small size."""
    rec, cpu = PLANS[chapter], plan(0, "smoke")
    here = None if chapter in TOO_LONG else lambda: rows_of(run_jobs(rec.jobs(machine, data)))
    rows, source = records.measured(
        rec.name, here, gpus=rec.gpus,
        stand_in=lambda: rows_of(run_jobs(rec.jobs(cpu, "synthetic"))))
    return from_rows(rows), source


TOO_LONG = ("05-200ep",)  # remade by `make records` alone, never inside a chapter


@dataclass
class ExperimentConfig(Config):
    """Train the runs of chapter 5, 5d or 5e (batches, or BatchNorm's groups) at full size and
    keep them as the chapter's record."""

    plan: Literal["05", "05-200ep", "05-loaders", "05d", "05e", "05e-bn"] = opt(
        "05", "whose runs: chapter 5 (1 and N GPUs; the 200-epoch run and the loaders on one), "
        "5d (schedules), 5e (batches) or 5e-bn (BatchNorm over fewer images)")
    gpus: int = opt(2, "chapter 5's largest GPU count (the other plans run on one GPU)")
    data: str = opt("auto", "CIFAR-10, as --data of the training entry point")
    record: bool = opt(False, "write the runs as the chapter's record (book/data)")
    only: str | None = opt(None, "train only these runs of the plan, by position (0,2 or 1-3); "
                           "with --record, they are added to the record of the other runs "
                           "made with the same code, so a long sweep can be made in parts")

    def __post_init__(self) -> None:
        check((self.gpus >= 1, f"--gpus must be >= 1, got {self.gpus}"))
        if self.only is not None:
            positions(self.only, 1 << 30)  # the syntax; the range is checked against the plan


def positions(only: str, n: int) -> list[int]:
    """The run positions ``only`` names ("0,2", "1-3"), each in range(n), in order."""
    out: set[int] = set()
    try:
        for part in only.split(","):
            first, _, last = part.strip().partition("-")
            out.update(range(int(first), int(last or first) + 1))
    except ValueError:
        raise ConfigError(f"--only takes run positions such as 0,2 or 1-3, got {only!r}") from None
    if not out or min(out) < 0 or max(out) >= n:
        raise ConfigError(f"--only {only}: the plan has runs 0 to {n - 1}")
    return sorted(out)


def _gpus_of(cfg: ExperimentConfig) -> int:
    return cfg.gpus if cfg.plan == "05" else PLANS[cfg.plan].gpus


def _enough_gpus(cfg: ExperimentConfig) -> None:
    if cfg.record:  # a record names the GPUs it was made on: never fewer, never CPU processes
        check_gpus(_gpus_of(cfg), "--gpus", "leave out --record to train on the CPU")


def main(argv: list[str] | None = None) -> None:
    cfg = parse_or_exit(ExperimentConfig, argv, __spec__.name, _enough_gpus)
    rec = PLANS[cfg.plan]
    gpus = _gpus_of(cfg)
    machine = plan(gpus, "full")
    jobs = rec.jobs(machine, cfg.data)
    try:
        chosen = positions(cfg.only, len(jobs)) if cfg.only else list(range(len(jobs)))
    except ConfigError as err:
        raise SystemExit(f"{__spec__.name}: {err}") from None
    runs = run_jobs([jobs[i] for i in chosen])
    print(runs_table(runs, reference=runs[0]))
    if cfg.record:  # the data's file name stands in the record, not where it lay
        shown = dataclasses.replace(cfg, data=Path(cfg.data).name, only=None)
        path, kept = records.write_part(rec.name, shown, rows_of(runs), [j.label for j in jobs],
                                        __spec__.name, ["tutorial_utils.train"], gpus=gpus,
                                        what=rec.what)
        done = {r["run"] for r in records.load(rec.name).rows}
        print(f"wrote {path}: {len(done)} of the plan's {len(jobs)} runs"
              + (f" ({kept} kept from an earlier part)" if kept else ""))


if __name__ == "__main__":
    main()
