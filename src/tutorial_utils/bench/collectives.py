"""The collectives over message sizes, and the alpha-beta model fitted to them (chapter 3b).

    python -m tutorial_utils.bench.collectives --nproc 2 --max-mb 256

Launches :mod:`tutorial_utils.bench.workers.collectives` under torchrun (NCCL on GPUs, gloo on
CPU processes), fits t(n) = alpha + n / beta to each collective's times, and checks the fit's
prediction for an all-reduce of WRN-28-10's gradients against chapter 4's all-reduce of
exactly that size, timed in the same run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch

from ..config import Config, check, check_gpus, check_wrn, opt, parse_or_exit
from ..devices import gpu_count
from ..launch import run_worker
from ..models.wrn import wide_resnet
from ..parallel.collectives import AlphaBeta, bus_factor, fit_alpha_beta
from . import records
from .report import Column
from .report import table as text_table
from .workers.collectives import COLLECTIVES, CollectiveRow, CollectivesWorkerConfig

RECORD = "03b-collectives"
WORKER = "tutorial_utils.bench.workers.collectives"
RING = "ring_all_reduce"
LABELS = {name: name.replace("_", "-") for name in COLLECTIVES} | {RING: "ring (by hand)"}
GRADIENTS_OF = "wrn-28-10"
MIN_BYTES = 4096  # the smallest message


def message_sizes(max_bytes: int, min_bytes: int = MIN_BYTES, factor: int = 4) -> list[int]:
    """``min_bytes``, ``min_bytes * factor``, ... up to ``max_bytes``."""
    sizes = [min_bytes]
    while sizes[-1] * factor <= max_bytes:
        sizes.append(sizes[-1] * factor)
    return sizes


def gradient_bytes(model: str = GRADIENTS_OF) -> int:
    """Bytes of the float32 gradients of ``model``: one per parameter, as DDP all-reduces."""
    with torch.device("meta"):  # shapes only: no memory, no initialisation work
        net = wide_resnet(model)
    return sum(p.numel() * p.element_size() for p in net.parameters() if p.requires_grad)


def human_bytes(n: float) -> str:
    unit, scale = next((u for u in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
                        if n >= u[1]), ("B", 1))
    return f"{n / scale:.{0 if n % scale == 0 else 1}f} {unit}"


@dataclass
class CollectivesConfig(Config):
    """The collectives over message sizes, and the alpha-beta model fitted to them."""

    nproc: int = opt(2, "processes, a power of two: one per GPU (CPU processes on a machine "
                     "without GPUs, or with --device cpu)")
    device: Literal["auto", "cpu", "cuda"] = opt("auto", "auto: cuda when there is a GPU per "
                                                 "process")
    max_mb: float | None = opt(None, "largest message in MiB, 0.004 to 8192 (default: 256 on "
                               "GPUs, 16 on CPUs)")
    factor: int = opt(2, "each size is this many times the one before, from 4 KiB (2..1024)")
    gradients_of: str = opt(GRADIENTS_OF, "the network whose gradients' all-reduce tests the fit")
    warmup: int = opt(5, "untimed calls of each collective at each size")
    repeats: int = opt(20, "timed calls; the median is reported")
    record: bool = opt(False, f"write the result as the record {RECORD} (book/data)")

    def __post_init__(self) -> None:
        check_wrn(self.gradients_of, "--gradients-of")
        check((self.nproc >= 2, f"--nproc must be >= 2: collectives need several processes, "
               f"got {self.nproc}"),
              # every size, 4 KiB x factor^k, is cut into float32 pieces, one per process
              (self.nproc < 2 or MIN_BYTES % (4 * self.nproc) == 0,
               f"--nproc must be a power of two that divides 1024 (2, 4, 8, ...), so that every "
               f"size splits evenly; got {self.nproc}"),
              # nan fails both comparisons; 8 GiB is as far as nccl-tests usually go
              (self.max_mb is None or MIN_BYTES <= self.max_mb * 2**20 <= 2**33,
               f"--max-mb must be in [0.004, 8192] (4 KiB to 8 GiB), got {self.max_mb}"),
              (2 <= self.factor <= 1024, f"--factor must be in 2..1024, got {self.factor}"),
              (self.max_mb is None or MIN_BYTES * self.factor <= self.max_mb * 2**20,
               f"--max-mb {self.max_mb} with --factor {self.factor} gives one message size, "
               f"and a fit needs two; use --max-mb >= {MIN_BYTES * self.factor / 2**20:g} or a "
               "smaller --factor"),
              (self.warmup >= 0, f"--warmup must be >= 0, got {self.warmup}"),
              (self.repeats >= 1, f"--repeats must be >= 1, got {self.repeats}"))

    def check_machine(self) -> None:
        """One GPU per process with --device cuda, and for a record (it names its GPUs); with
        --device auto, fewer GPUs than processes run CPU processes instead, and say so."""
        if self.device == "cuda":
            check_gpus(self.nproc, "--nproc", "--device cpu (gloo between CPU processes)",
                       fewest=2)
        elif self.record:
            check_gpus(self.nproc, "--nproc", "leave out --record to time CPU processes",
                       fewest=2)

    @property
    def on(self) -> str:
        """The device the processes use."""
        if self.device != "auto":
            return self.device
        return "cuda" if gpu_count() >= self.nproc else "cpu"


def run(cfg: CollectivesConfig, timeout_s: float = 900) -> list[CollectiveRow]:
    """Time every collective over the sizes of ``cfg`` (the hand-written ring at every fourth
    size and the largest; chapter 4's all-reduce at WRN-28-10's gradient bytes) in
    ``cfg.nproc`` processes; return the workers' records."""
    sizes = message_sizes(int((cfg.max_mb or (256 if cfg.on == "cuda" else 16)) * 2**20),
                          factor=cfg.factor)
    worker = CollectivesWorkerConfig(
        sizes=tuple(sizes), ring_sizes=tuple(sorted(set(sizes[::4] + sizes[-1:]))),
        check_bytes=gradient_bytes(cfg.gradients_of), warmup=cfg.warmup, repeats=cfg.repeats,
        device=cfg.on)
    return run_worker(WORKER, worker, nproc=cfg.nproc, timeout_s=timeout_s,
                      row_type=CollectiveRow)


def measured(cfg: CollectivesConfig) -> tuple[list[CollectiveRow], records.Source]:
    """Chapter 3b's collectives between ``cfg.nproc`` GPUs (NCCL): the record's; this
    machine's with TUTORIAL_MEASURE=1; without a record, ``cfg.nproc`` CPU processes (gloo)."""
    on = {d: dataclasses.replace(cfg, device=d) for d in ("cuda", "cpu")}
    return records.measured(
        RECORD, lambda: run(on["cuda"]), gpus=cfg.nproc, cfg=cfg, row_type=CollectiveRow,
        stand_in=lambda: run(on["cpu"]), stand_in_where="CPU processes (gloo)",
        compare=records.Compare(("collective", "nbytes"), "busbw_gbps", "collective bytes: "
                                "bus GB/s"))


def sweep(records: list[CollectiveRow], collective: str) -> list[CollectiveRow]:
    return sorted((r for r in records if r.role == "sweep" and r.collective == collective),
                  key=lambda r: r.nbytes)


def fit(records: list[CollectiveRow]) -> dict[str, AlphaBeta]:
    """The alpha-beta model of each collective measured at two sizes or more."""
    points = {name: sweep(records, name) for name in (*COLLECTIVES, RING)}
    return {name: fit_alpha_beta([r.nbytes for r in p], [r.time_s for r in p])
            for name, p in points.items() if len(p) >= 2}


def worst_error(records: list[CollectiveRow], name: str, model: AlphaBeta) -> float:
    """The largest |predicted / measured - 1| over the sizes the model was fitted to."""
    return max(abs(model.predict_s(r.nbytes) / r.time_s - 1) for r in sweep(records, name))


def table(records: list[CollectiveRow]) -> str:
    """Bus bandwidth (GB/s) of each collective at each size; ``-`` where not measured."""
    names = [n for n in (*COLLECTIVES, RING) if sweep(records, n)]
    rows: dict[int, dict] = {}
    for name in names:
        for r in sweep(records, name):
            rows.setdefault(r.nbytes, {"size": human_bytes(r.nbytes)})[name] = r.busbw_gbps
    columns = [Column("size", "size", width=10, left=True)]
    columns += [Column(n, LABELS[n], ".2f", max(len(LABELS[n]) + 2, 10)) for n in names]
    return "bus bandwidth, GB/s\n" + text_table([rows[k] for k in sorted(rows)], columns)


def fit_table(records: list[CollectiveRow], fits: dict[str, AlphaBeta]) -> str:
    """alpha, beta (and beta as a bus bandwidth), n_1/2 and the worst error of each fit."""
    n = records[0].world_size
    rows = [{"name": LABELS[k], "alpha": m.alpha_s * 1e6, "beta": m.beta / 1e9,
             "bus": m.beta * bus_factor(k, n) / 1e9, "half": human_bytes(m.half_bytes),
             "err": worst_error(records, k, m) * 100} for k, m in fits.items()]
    return text_table(rows, [
        Column("name", "collective", width=16, left=True), Column("alpha", "alpha us", ".1f"),
        Column("beta", "beta GB/s", ".2f", 11), Column("bus", "as busbw", ".2f"),
        Column("half", "n_1/2", width=11), Column("err", "worst err %", ".0f", 13)])


def plot(records: list[CollectiveRow], fits: dict[str, AlphaBeta], title: str):
    """Measured time against size, log-log, one panel per collective, with its fitted model."""
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(2, 2, figsize=(8, 6.4), sharex=True, sharey=True)
    right = max(r.nbytes for r in records if r.nbytes) * 1.3  # the check may lie beyond
    for ax, name in zip(axes.flat, COLLECTIVES, strict=True):
        points, model = sweep(records, name), fits[name]
        x = np.array([r.nbytes for r in points])
        t, q25, q75 = (np.array([getattr(r, k) for r in points]) * 1e6
                       for k in ("time_s", "q25_s", "q75_s"))
        ax.errorbar(x, t, yerr=[t - q25, q75 - t], fmt="o", ms=4,
                    label="measured (median, quartiles)")
        grid = np.geomspace(x.min(), right, 100)
        ax.plot(grid, [model.predict_s(g) * 1e6 for g in grid], "-", color="C1",
                label=rf"fit: $\alpha$ = {model.alpha_s * 1e6:.1f} us, "
                      rf"$\beta$ = {model.beta / 1e9:.1f} GB/s")
        if name == "all_reduce":
            _plot_ring_and_check(ax, records, model)
        ax.set(xscale="log", yscale="log", title=LABELS[name])
        ax.legend(fontsize=7, loc="upper left")
    fig.supxlabel("message size (bytes)", fontsize=9)
    fig.supylabel("time (us)", fontsize=9)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def _plot_ring_and_check(ax, records: list[CollectiveRow], model: AlphaBeta) -> None:
    if ring := sweep(records, RING):
        ax.plot([r.nbytes for r in ring], [r.time_s * 1e6 for r in ring], "s", mfc="none",
                color="C2", label="ring by hand (send/recv)")
    if check := next((r for r in records if r.role == "check"), None):
        ax.plot(check.nbytes, check.time_s * 1e6, "*", ms=11, color="C3",
                label=f"chapter 4's all-reduce, {GRADIENTS_OF.upper()} gradients")
        ax.plot(check.nbytes, model.predict_s(check.nbytes) * 1e6, "x", ms=9, mew=2,
                color="k", label="the fit's prediction for it")


def summary(records: list[CollectiveRow],
            fits: dict[str, AlphaBeta]) -> dict[str, float | str | int]:
    """Flat numbers for the chapter's prose (``glue_summary``)."""
    n, out = records[0].world_size, {}
    for name, model in fits.items():
        first, *_, last = sweep(records, name)
        out |= {f"{name}_alpha_us": model.alpha_s * 1e6, f"{name}_beta_gbps": model.beta / 1e9,
                f"{name}_beta_bus_gbps": model.beta * bus_factor(name, n) / 1e9,
                f"{name}_half_mb": model.half_bytes / 1e6, f"{name}_err_pct":
                worst_error(records, name, model) * 100, f"{name}_small_us": first.time_s * 1e6,
                f"{name}_large_busbw_gbps": last.busbw_gbps}
    top = {name: sweep(records, name)[-1] for name in fits}
    all_reduce = {r.nbytes: r for r in sweep(records, "all_reduce")}
    out |= {"nproc": n, "backend": records[0].backend, "n_sizes": len(all_reduce),
            "min_size": human_bytes(min(all_reduce)), "max_size": human_bytes(max(all_reduce)),
            "ring_max_diff": next(r.max_diff for r in records if r.role == "equal"),
            "rs_ag_over_ar": (top["reduce_scatter"].time_s + top["all_gather"].time_s)
            / top["all_reduce"].time_s}
    if ring := top.get(RING):
        out |= {"ring_size": human_bytes(ring.nbytes),
                "ring_over_builtin": ring.time_s / all_reduce[ring.nbytes].time_s}
    return out | _gradient_summary(records, fits["all_reduce"], max(all_reduce))


def _gradient_summary(records: list[CollectiveRow], model: AlphaBeta, largest: int) -> dict:
    if (check := next((r for r in records if r.role == "check"), None)) is None:
        return {}
    nbytes, measured, predicted = check.nbytes, check.time_s, model.predict_s(check.nbytes)
    error = abs(predicted / measured - 1)
    return {"grad_mb": nbytes / 1e6, "grad_params_m": nbytes / 4 / 1e6,
            "grad_pred_ms": predicted * 1e3, "grad_meas_ms": measured * 1e3,
            "grad_pred_over_meas": predicted / measured, "grad_err_pct": error * 100,
            "grad_verdict": "within" if error <= 0.10 else "outside",
            "grad_busbw_gbps": check.busbw_gbps, "grad_where": "inside" if nbytes <= largest
            else "beyond"}


def main(argv: list[str] | None = None) -> None:
    cfg = parse_or_exit(CollectivesConfig, argv, __spec__.name,
                        CollectivesConfig.check_machine)
    if cfg.on == "cpu":
        print(f"{cfg.nproc} CPU processes (gloo): this machine has {gpu_count()} GPU(s) for "
              f"{cfg.nproc} processes" if gpu_count() else f"{cfg.nproc} CPU processes (gloo)")
    rows = run(cfg)
    fits = fit(rows)
    s = summary(rows, fits)
    print(table(rows), fit_table(rows, fits), sep="\n\n")
    print(f"\nall-reduce of {s['grad_mb']:.1f} MB ({GRADIENTS_OF} gradients): predicted "
          f"{s['grad_pred_ms']:.3f} ms, measured {s['grad_meas_ms']:.3f} ms")
    if cfg.record:
        path = records.write(RECORD, cfg, rows, __spec__.name, [WORKER], gpus=cfg.nproc,
                             what="Chapter 3b: the collectives between GPUs over message sizes, "
                                  "and the alpha-beta model fitted to them")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
