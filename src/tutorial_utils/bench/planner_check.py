"""Chapter 8: the planner's predictions beside the step times the chapter measured.

:func:`tutorial_utils.parallel.planner.compare` sets a prediction beside each measurement;
this module turns the chapter's measurements into :class:`~tutorial_utils.parallel.planner.
Measurement` s (the pipeline schedules of :mod:`.pipeline_schedules`, the composed mesh of
:mod:`tutorial_utils.workers.hybrid_check`) and gives the planner a machine to predict for.

On CPU processes the "GPU" is a CPU process: its peak is the rate of a float32 matrix product
on one thread (:func:`tutorial_utils.parallel.planner.matmul_flops`), shared with the other
processes where there are fewer cores than processes; its efficiency is fitted on one process
running the same GPT at the same micro-batch
(:func:`tutorial_utils.parallel.planner.fitted_efficiency`: at these sizes per-call costs, not
FLOPs, set the time, and a matrix product's rate alone predicts the runs twenty times too
fast); its link is gloo's, from chapter 3b's alpha-beta fit of the all-reduce
(:func:`cpu_link`). All are measured on the machine that runs the chapter, so the error printed
is what the model leaves out: the schedules' own Python overhead per action, waits longer than
the alpha-beta model's for small messages, and other work on a shared machine.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..parallel import planner
from ..parallel.collectives import AlphaBeta
from .report import Column, table


def cpu_link(fits: dict[str, AlphaBeta], processes: int) -> planner.Link:
    """Gloo's link from chapter 3b's fits (:func:`tutorial_utils.bench.collectives.fit`), its
    all-reduce measured on ``processes`` processes."""
    return planner.Link.from_all_reduce_fit(fits["all_reduce"], processes)


def from_schedules(rows: Sequence, cfg) -> list[planner.Measurement]:
    """The pipeline benchmark's rows (:class:`.pipeline_schedules.ScheduleRow`) measured with
    ``cfg`` (:class:`.pipeline_schedules.PipelineSchedulesConfig`): forward and backward in
    float32, the batch m micro-batches of ``cfg.micro_batch`` sequences."""
    out = []
    for r in rows:
        model = planner.ModelShape(cfg.layers, cfg.dim, cfg.heads, cfg.seq,
                                   batch=r.micro_batches * cfg.micro_batch)
        layout = planner.Layout(pp=r.ranks, micro_batch=cfg.micro_batch, schedule=r.schedule)
        out.append(planner.Measurement(f"{r.schedule} m={r.micro_batches}", model, layout,
                                       r.step_ms, planner.Recipe("adam", "fp32")))
    return out


def from_hybrid(row, cfg) -> planner.Measurement:
    """The composed mesh's row (:class:`tutorial_utils.workers.hybrid_check.HybridRow`, with
    ``--repeats``) measured with ``cfg`` (its :class:`HybridConfig`)."""
    model = planner.ModelShape(cfg.layers, cfg.dim, cfg.heads, cfg.seq, batch=cfg.batch)
    mb = cfg.batch // cfg.dp // cfg.micro_batches
    layout = planner.Layout(cfg.dp, cfg.tp, cfg.pp, cfg.cp, mb, cfg.schedule, "ZeRO-3")
    return planner.Measurement(f"{cfg.schedule} mesh", model, layout, row.step_ms,
                               planner.Recipe("adam", "fp32"))


COLUMNS = (Column("label", "measured run", width=24, left=True),
           Column("layout", "layout", width=20, left=True),
           Column("measured_ms", "measured ms", ".1f", 12),
           Column("predicted_ms", "predicted ms", ".1f", 13),
           Column("error_pct", "error", "+.0f", 8, unit=" %"))


def error_table(rows: Sequence[planner.ErrorRow]) -> str:
    return table([{"label": r.label, "layout": r.layout, "measured_ms": r.measured_ms,
                   "predicted_ms": r.predicted_ms, "error_pct": r.error_pct} for r in rows],
                 COLUMNS)


def error_figure(rows: Sequence[planner.ErrorRow], title: str):
    """Predicted against measured step time, one point per run, the diagonal and +-25 %."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.2, 4.2))
    measured = [r.measured_ms for r in rows]
    predicted = [r.predicted_ms for r in rows]
    ax.scatter(measured, predicted, s=18)
    lo, hi = min(measured + predicted) * 0.8, max(measured + predicted) * 1.25
    ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8)
    for k in (0.75, 1.25):
        ax.plot([lo, hi], [k * lo, k * hi], color="grey", lw=0.6, ls=":")
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="measured step (ms)",
           ylabel="predicted step (ms)", title=title)
    fig.tight_layout()
    return fig
