"""Chapter 2's measurements: host-to-GPU copies and the single-GPU speed ladder.

The ladder times one full training step (forward, loss, backward, SGD update) of a
Wide-ResNet, adding one optimisation per rung: TF32 matmuls/convs, bf16 autocast,
channels_last memory format, torch.compile, and CUDA graphs. Each rung also records how long
the host takes just to *queue* a step: when that approaches the step time, the GPU is waiting
for Python and only fewer launches (fusion, CUDA graphs) make it faster.
"""

from __future__ import annotations

import torch

from ..timing import benchmark
from .report import Column, table
from .workload import LADDER, Rung, RungResult, Workload, make_train_step, measure_rung


def measure_ladder(
    size: Workload, device: torch.device, rungs: tuple[Rung, ...] = LADDER
) -> list[RungResult]:
    """Measure every rung in order (cuDNN autotuning on: the shapes never change)."""
    return [measure_rung(r, size, device) for r in rungs]


def host_to_device_gbps(
    nbytes: int, device: torch.device, pinned: bool, repeats: int = 10
) -> float | None:
    """Copy bandwidth from host memory to ``device`` in GB/s (None on the CPU)."""
    if device.type != "cuda":
        return None
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    timing = benchmark(
        lambda: host.to(device, non_blocking=pinned), warmup=2, repeats=repeats, device=device
    )
    return nbytes / timing.median_ms / 1e6


LADDER_COLUMNS = (Column("rung", "rung", width=18, left=True), Column("ms", "step (ms)", ".2f", 11),
                  Column("iqr", "IQR", ".1%", 7), Column("host", "queue (ms)", ".2f", 12),
                  Column("ips", "images/s", ".0f"), Column("x", "speed-up", ".2f", unit="x"),
                  Column("note", "", width=2, left=True, missing=""))


def ladder_table(results: list[RungResult]) -> str:
    """Rung, median step time and spread, host queueing time, images/s, speed-up over rung 1."""
    base = results[0].timing.median_ms
    rows = [{"rung": r.rung.name, "note": f"  skipped: {r.skipped}"} if r.timing is None else
            {"rung": r.rung.name, "ms": r.timing.median_ms, "iqr": r.timing.spread,
             "host": r.host_ms, "ips": r.images_per_s, "x": base / r.timing.median_ms}
            for r in results]
    return table(rows, LADDER_COLUMNS)


def plot_ladder(results: list[RungResult], title: str):
    """Horizontal bars of images/s per rung, first rung on top, each labelled with its speed-up
    over the first (horizontal, so that the rungs' names never collide)."""
    import matplotlib.pyplot as plt

    measured = [r for r in results if r.timing is not None]
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(measured) + 1.0))
    names = [r.rung.name for r in measured]
    rates = [r.images_per_s for r in measured]
    bars = ax.barh(names, rates, color="#4c72b0")
    for bar, rate in zip(bars, rates, strict=True):
        ax.annotate(f" {rate / rates[0]:.2f}x", (rate, bar.get_y() + bar.get_height() / 2),
                    ha="left", va="center", fontsize=9)
    ax.invert_yaxis()
    ax.set_xlabel("training images / s")
    ax.set_title(title, fontsize=10)
    ax.margins(x=0.12)
    fig.tight_layout()
    return fig


def step_tflop(size: Workload, device: torch.device) -> float:
    """Floating-point operations of one training step (forward + backward), in TFLOP."""
    from torch.utils.flop_counter import FlopCounterMode

    step = make_train_step(LADDER[0], size, device)
    with FlopCounterMode(display=False) as counter:
        step()
    return counter.get_total_flops() / 1e12


SLUGS = ("fp32", "tf32", "bf16", "cl", "compile", "graphs")  # glue names of LADDER's rungs


def ladder_summary(results: list[RungResult], tflop: float) -> dict[str, float | str]:
    """Flat summary of a measured ladder for the chapter's prose (NaN where skipped)."""
    nan = float("nan")
    base = results[0].timing.median_ms
    out: dict[str, float | str] = {}
    for slug, r in zip(SLUGS, results, strict=True):
        ms = r.timing.median_ms if r.timing else nan
        out |= {f"ladder_{slug}_ips": float(r.images_per_s or nan), f"ladder_{slug}_ms": ms,
                f"ladder_{slug}_host_ms": float(r.host_ms or nan),
                f"ladder_{slug}_x": base / ms, f"ladder_{slug}_tflops": tflop / ms * 1e3}
    eager, compiled, graphs = results[3], results[4], results[-1]
    launch_bound = eager.host_ms > 0.8 * eager.timing.median_ms
    out["cl_verdict"] = ("the GPU is waiting for the CPU" if launch_bound
                         else "the CPU stays ahead of the GPU")
    graphs_ms = graphs.timing.median_ms if graphs.timing else nan
    first_ms = graphs.first_step_ms or nan
    gain = eager.timing.median_ms / compiled.timing.median_ms
    out |= {"graphs_over_cl": eager.timing.median_ms / graphs_ms, "graphs_first_s": first_ms / 1e3,
            "graphs_breakeven": break_even_steps(first_ms, eager.timing.median_ms, graphs_ms),
            "compile_over_cl": gain, "compile_verdict": "shortened" if gain > 1 else "lengthened",
            "compile_first_s": (compiled.first_step_ms or nan) / 1e3}
    return out


def break_even_steps(first_ms: float, eager_ms: float, fast_ms: float) -> float:
    """Steps after which a slow first step (compilation, capture) has paid for itself: the
    extra first-step time over the time each later step saves (NaN if none is saved)."""
    saved = eager_ms - fast_ms
    return (first_ms - fast_ms) / saved if saved > 0 else float("nan")

