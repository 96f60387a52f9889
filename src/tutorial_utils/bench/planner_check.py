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
    hi = max(measured + predicted) * 1.15
    ax.plot([0, hi], [0, hi], color="grey", lw=0.8)
    for k in (0.75, 1.25):
        ax.plot([0, hi], [0, k * hi], color="grey", lw=0.6, ls=":")
    ax.set(xlim=(0, hi), ylim=(0, hi), xlabel="measured step (ms)", ylabel="predicted step (ms)",
           title=title)
    fig.tight_layout()
    return fig


def gpu_hardware() -> tuple[planner.Hardware, str]:
    """An H100 SXM as this book measured it, and where each number comes from: its dense bf16
    peak (NVIDIA's datasheet), the fraction of that peak chapter 7's GPT reached at its best
    batch (its record) and the all-reduce bus bandwidth of chapter 4's record over NVLink."""
    import dataclasses

    from . import records
    from .mfu import peak_of
    from .transformer import link_bus_gbps

    steps = records.load("07-gpt-steps")
    best = max((r["tflops"] for r in steps.rows if r.get("tflops")), default=None) \
        if steps else None
    bus, where = link_bus_gbps()
    peak = peak_of("NVIDIA H100 80GB HBM3").flops
    hw = dataclasses.replace(planner.H100, peak_flops=peak,
                             link=planner.Link(planner.H100.link.alpha_s, bus * 1e9),
                             efficiency=best * 1e12 / peak if best else planner.H100.efficiency)
    said = (f"{hw.name}: {hw.memory_bytes / 1e9:.0f} GB, {hw.peak_flops / 1e12:.0f} TFLOP/s dense "
            f"bf16 at {hw.efficiency:.0%}"
            + (f" (chapter 7's GPT on {steps.hardware})" if best else " (assumed)")
            + f";\n  links of {bus:.0f} GB/s bus bandwidth:\n  {where}")
    return hw, said


PLAN_COLUMNS = (Column("layout", "layout", width=18, left=True),
                Column("state_gib", "state GiB", ".1f", 10),
                Column("activations_gib", "activ. GiB", ".1f", 11),
                Column("memory_gib", "total GiB", ".1f", 10), Column("fits", "fits", width=5),
                Column("compute_ms", "compute", ".0f", 8), Column("bubble_ms", "bubble", ".0f", 7),
                Column("comm_ms", "comm.", ".0f", 6), Column("step_ms", "step ms", ".0f", 8))


def plan_rows(plans: Sequence[planner.Plan]) -> list[dict]:
    """One row per layout: memory on the most loaded GPU, and where the step's time goes."""
    rows = []
    for p in plans:
        row, t = p.row(), p.time
        row |= {"state_gib": row["params_gib"] + row["grads_gib"] + row["optimizer_gib"],
                "fits": "yes" if p.fits else "no", "compute_ms": t.compute * 1e3,
                "bubble_ms": t.bubble * 1e3, "comm_ms": (t.tp + t.pp + t.cp + t.dp) * 1e3}
        rows.append(row)
    return rows


def plan_table(plans: Sequence[planner.Plan]) -> str:
    return table(plan_rows(plans), PLAN_COLUMNS)


def plan_figure(plans: Sequence[planner.Plan], hw: planner.Hardware, title: str):
    """Every layout's predicted step time against its memory per GPU, the GPU's usable memory
    as a line: the planner picks the lowest point left of the line."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    chosen = planner.best(plans)
    gib = 2**30
    for fits, marker in ((True, "o"), (False, "x")):
        mine = [p for p in plans if p.fits == fits]
        if mine:  # no empty legend entry when every layout fits
            ax.scatter([p.memory.total / gib for p in mine], [p.step_ms / 1e3 for p in mine],
                       s=22, marker=marker, label="fits" if fits else "does not fit")
    ax.axvline(hw.memory_bytes * hw.usable / gib, color="grey", lw=0.8, ls="--")
    ax.annotate(str(chosen.layout), (chosen.memory.total / gib, chosen.step_ms / 1e3),
                textcoords="offset points", xytext=(8, -4), fontsize=8)
    ax.set(xlim=(0, None), xlabel="memory per GPU (GiB, most loaded stage)",
           ylabel="predicted step (s)", title=title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def cpu_machine(processes: int, cfg, sequences: int) -> tuple[planner.Hardware, str]:
    """CPU processes standing in for ``processes`` GPUs, each number measured here: a float32
    matrix product's rate on one thread, the fraction of it the GPT ``cfg`` reaches on one
    process at ``sequences`` sequences, and gloo's all-reduce fitted as in chapter 3b."""
    import os

    from ..parallel.collectives import fit_alpha_beta
    from .collectives import CollectivesConfig, run, sweep

    rate = planner.matmul_flops()
    efficiency = planner.fitted_efficiency(cfg, sequences, rate)
    # all-reduce from 4 KiB to 16 MiB: large enough that the time grows with the bytes
    times = sweep(run(CollectivesConfig(nproc=processes, device="cpu", max_mb=16, factor=4,
                                        warmup=2, repeats=5)), "all_reduce")
    fits = {"all_reduce": fit_alpha_beta([r.nbytes for r in times], [r.time_s for r in times])}
    link = cpu_link(fits, processes)
    cores = os.cpu_count() or 1
    hw = planner.cpu_hardware(rate, link, processes, cores, efficiency)
    said = (f"{hw.name}: {rate / 1e9:.1f} GFLOP/s per thread at {efficiency:.0%} (fitted on "
            f"one process);\n  gloo's all-reduce: {link.alpha_s * 1e6:.0f} us + bytes / "
            f"{link.bus_bytes_per_s / 1e9:.2f} GB/s of bus bandwidth")
    return hw, said


# The composed meshes of chapter 8 on 8 processes, (dp, pp, cp, tp): 3-D without context,
# 4-D with it (every dimension but dp splits something).
MESHES = ((2, 2, 1, 2), (1, 2, 2, 2))


def hybrid_rows(device: str = "cpu", meshes=MESHES) -> list:
    """:mod:`tutorial_utils.workers.hybrid_check` on each mesh (8 processes for the default
    ones): its rows, each against one process."""
    from ..launch import run_worker
    from ..workers.hybrid_check import HybridConfig, HybridRow

    configs = [HybridConfig(dp=dp, pp=pp, cp=cp, tp=tp, device=device)
               for dp, pp, cp, tp in meshes]
    return [run_worker("tutorial_utils.workers.hybrid_check", c, nproc=c.shape.size,
                       timeout_s=600, row_type=HybridRow)[0] for c in configs]


def hybrid_table(rows: Sequence) -> str:
    """Per mesh: the largest differences from one process over its steps, and the range of
    parameter values and bytes (weights, gradients, AdamW's moments) a rank holds."""
    def span(values) -> str:
        return f"{min(values):,}-{max(values):,}" if min(values) != max(values) \
            else f"{values[0]:,}"

    lines = [{"mesh": " x ".join(f"{k}{v}" for k, v in r.mesh.items()), "steps": r.steps,
              "loss_diff": r.loss_diff, "grad_diff": r.grad_diff,
              "params": span(r.params_per_rank),
              "bytes": span([p + g + o for p, g, o in zip(r.param_bytes, r.grad_bytes,
                                                          r.optimizer_bytes, strict=True)])}
             for r in rows]
    return table(lines, (
        Column("mesh", "mesh", width=22, left=True), Column("steps", "steps", width=6),
        Column("loss_diff", "loss diff", ".0e", 10), Column("grad_diff", "grad diff", ".0e", 10),
        Column("params", "params per rank", width=17), Column("bytes", "bytes per rank", width=17)))


def plan_summary(plans: Sequence[planner.Plan], model: planner.ModelShape) -> dict:
    """Chapter 8's glue for the plans of one model: the layout chosen, how many fit, the
    compute's share of the chosen step, how much slower the slowest fitting layout is, and the
    range of memory per GPU."""
    chosen, fitting = planner.best(plans), [p for p in plans if p.fits]
    gib = 2**30
    return {"plan_chosen": str(chosen.layout), "plan_n": len(plans), "plan_fits": len(fitting),
            "plan_params": f"{model.params / 1e9:.1f}",
            "plan_spread": f"{100 * (max(p.step_ms for p in fitting) / chosen.step_ms - 1):.0f}",
            "plan_compute": f"{100 * chosen.time.compute / chosen.time.total:.0f}",
            "plan_mem_min": f"{min(p.memory.total for p in plans) / gib:.0f}",
            "plan_mem_max": f"{max(p.memory.total for p in plans) / gib:.0f}"}
