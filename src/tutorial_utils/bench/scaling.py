"""The scaling benchmark of chapter 5b: a Wide-ResNet on one GPU and on N with DDP.

    python -m tutorial_utils.bench_scaling --gpus 2 4 --json runs/bench.json

Strong scaling keeps the global batch (the Torch7 post split its 128 across the GPUs); weak
scaling keeps the per-GPU batch. Each regime runs eager, with CUDA graphs of the network
(``torch.compile(mode="reduce-overhead")``) and as a "step graph" (the whole step, all-reduces
and fused SGD included, as one CUDA graph: :class:`~tutorial_utils.step_graph.StepGraph`), with
DataParallel for comparison. Every speed-up is against the best single-GPU run of the same
invocation at the same global (strong) or per-GPU (weak) batch. The prediction is chapter 4's
model: the DDP step inside ``no_sync`` plus a ring all-reduce at the bus bandwidth measured in
the same run.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .devices import NotEnoughGPUsError, gpu_count, require_gpus
from .parallel.ddp import ring_all_reduce_seconds
from .report import legend_outside
from .workload import LADDER, LadderSize, measure_rung, time_data_parallel, time_ddp

TRAIN_IMAGES = 50_000
MODES = {"eager": LADDER[3], "CUDA graphs": LADDER[-1]}
STEP_GRAPH = "step graph"  # measured by workers.step_timing in 1 or N processes alike
GPU_ONLY_MODES = ("CUDA graphs", STEP_GRAPH)


@dataclass
class Run:
    regime: str  # "single", "strong" or "weak"
    method: str  # "1 GPU", "DDP" or "DataParallel"
    mode: str  # "eager", "CUDA graphs" or "step graph"
    gpus: int
    per_gpu_batch: int
    step_ms: float
    predicted_ms: float | None = None  # DDP: compute + all-reduce, no overlap (chapter 4)
    speedup: float | None = None  # over the best single-GPU run of the same regime
    predicted: float | None = None  # the speed-up predicted_ms would give

    @property
    def images_per_s(self) -> float:
        return self.per_gpu_batch * self.gpus / self.step_ms * 1e3

    @property
    def epoch_s(self) -> float:
        return TRAIN_IMAGES / self.images_per_s


def single(model: str, batch: int, mode: str, repeats: int, device: str) -> Run:
    if mode == STEP_GRAPH:
        rec = time_ddp(LadderSize(model, batch, 5, repeats), 1, device, "default", capture=True)
        return Run("single", "1 GPU", mode, 1, batch, rec["ddp_ms"])
    dev = torch.device("cuda:0" if device == "cuda" else "cpu")
    # A fresh compilation per batch size: otherwise the second size recompiles the network
    # with a symbolic batch dimension, which is slower than either specialised graph.
    torch.compiler.reset()
    result = measure_rung(MODES[mode], LadderSize(model, batch, 5, repeats), dev)
    if result.timing is None:
        raise RuntimeError(f"{mode} cannot run here: {result.skipped}")
    return Run("single", "1 GPU", mode, 1, batch, result.timing.median_ms)


def ddp_run(model: str, per_gpu: int, n: int, mode: str, repeats: int, regime: str,
            device: str) -> Run:
    size = LadderSize(model, per_gpu, 5, repeats)
    if mode == STEP_GRAPH:
        rec = time_ddp(size, n, device, "default", capture=True)
    else:
        compile_mode = MODES[mode].compile_mode or "none"  # the same step as the single GPU's
        rec = time_ddp(size, n, device, compile_mode)
    ring_ms = ring_all_reduce_seconds(rec["grad_bytes"], n, rec["bus_gbps"]) * 1e3
    return Run(regime, "DDP", mode, n, per_gpu, rec["ddp_ms"],
               predicted_ms=rec["no_sync_ms"] + ring_ms)


def run(model: str = "wrn-28-10", gpus: Sequence[int] = (2,), global_batch: int = 128,
        per_gpu_batch: int = 128, modes: tuple[str, ...] = ("eager", "CUDA graphs"),
        repeats: int = 20, data_parallel: bool = True, device: str | None = None) -> list[Run]:
    """Every run of the benchmark for each GPU count in ``gpus``, with its speed-ups.

    ``device`` "cpu" makes the "GPUs" CPU processes (the default without GPUs); on "cuda"
    (the default with GPUs) asking for more GPUs than there are is an error rather than a
    silent run on the CPU.
    """
    device = device or ("cuda" if gpu_count() else "cpu")
    for n in gpus:  # every setting checked before any GPU count: the same error everywhere
        if n < 2:
            raise ValueError(f"scaling needs 2 or more GPUs per run, got {n}")
        if global_batch % n:
            raise ValueError(f"global batch {global_batch} is not divisible by {n} GPUs")
    if device == "cuda":
        require_gpus(max(gpus))
    # The single-GPU references, plus the per-GPU batch of strong scaling on two GPUs.
    batches = sorted({global_batch, per_gpu_batch, global_batch // 2})
    runs = [single(model, b, m, repeats, device) for b in batches for m in modes]
    for n in gpus:
        for regime, per_gpu in (("strong", global_batch // n), ("weak", per_gpu_batch)):
            runs += [ddp_run(model, per_gpu, n, mode, repeats, regime, device) for mode in modes]
            if data_parallel and device == "cuda":
                size = LadderSize(model, per_gpu, 5, repeats)
                ms = time_data_parallel(size, n, cudnn_benchmark=False)
                runs.append(Run(regime, "DataParallel", "eager", n, per_gpu, ms))
    for r in (r for r in runs if r.regime != "single"):
        reference = global_batch if r.regime == "strong" else per_gpu_batch
        best = min(s.step_ms for s in runs if s.regime == "single" and s.per_gpu_batch == reference)
        best_rate = reference / best  # images per ms of the best single-GPU run
        images = r.per_gpu_batch * r.gpus
        r.speedup = images / r.step_ms / best_rate
        if r.predicted_ms:
            r.predicted = images / r.predicted_ms / best_rate
    return runs


def best_run(runs: list[Run], regime: str, method: str = "DDP", mode: str | None = None,
             gpus: int | None = None, batch: int | None = None) -> Run | None:
    """The fastest run matching the filters (``None`` matches anything), or None."""
    found = [r for r in runs if (r.regime, r.method) == (regime, method)
             and mode in (None, r.mode) and gpus in (None, r.gpus)
             and batch in (None, r.per_gpu_batch)]
    return max(found, key=lambda r: r.per_gpu_batch * r.gpus / r.step_ms, default=None)


def summary(runs: list[Run], global_batch: int) -> dict[str, float | str | int]:
    """Flat summary for the chapter's prose: single-GPU steps, then each regime's speed-ups."""
    nan = float("nan")
    out: dict[str, float | str | int] = {}
    for name, batch in (("ref", global_batch), ("half", global_batch // 2)):
        eager = best_run(runs, "single", "1 GPU", "eager", batch=batch)
        out[f"batch_{name}"] = batch
        out[f"eager_{name}_ms"] = eager.step_ms
        for mode, key in (("CUDA graphs", "graphs"), (STEP_GRAPH, "whole")):
            r = best_run(runs, "single", "1 GPU", mode, batch=batch)
            out[f"{key}_{name}_ms"] = r.step_ms if r else nan
            gain = "graph_gain" if key == "graphs" else "whole_gain"
            out[f"{gain}_{name}"] = eager.step_ms / r.step_ms if r else nan
    multi = sorted({r.gpus for r in runs if r.regime != "single"})
    for tag, n in (("2", multi[0]), ("max", multi[-1])):
        for regime in ("strong", "weak"):
            best = best_run(runs, regime, gpus=n)
            dp = best_run(runs, regime, "DataParallel", gpus=n)
            out |= {f"{regime}_{tag}_x": best.speedup, f"{regime}_{tag}_mode": best.mode,
                    f"{regime}_{tag}_pred": best.predicted,
                    f"{regime}_{tag}_dp": dp.speedup if dp else nan}
            for mode, key in (("eager", "eager"), ("CUDA graphs", "graphs"), (STEP_GRAPH, "whole")):
                r = best_run(runs, regime, mode=mode, gpus=n)
                out[f"{regime}_{tag}_{key}_x"] = r.speedup if r else nan
                out[f"{regime}_{tag}_{key}_pred"] = r.predicted if r else nan
                out[f"{regime}_{tag}_{key}_ms"] = r.step_ms if r else nan
    out["bench_n_max"] = multi[-1]
    out["strong_max_per_gpu"] = global_batch // multi[-1]
    return out


def strong_ceiling(runs: list[Run], global_batch: int, n: int) -> float:
    """Exercise (chapter 5b): the strong-scaling speed-up of ``n`` GPUs if communication were free.

    Each GPU would take the best single-GPU step at ``global_batch // n`` images, and one GPU
    takes its best step at ``global_batch``: the ratio of the two is the ceiling.
    """
    whole = best_run(runs, "single", "1 GPU", batch=global_batch)
    part = best_run(runs, "single", "1 GPU", batch=global_batch // n)
    if whole is None or part is None:
        raise ValueError(f"needs single-GPU runs at {global_batch} and {global_batch // n} images")
    return whole.step_ms / part.step_ms


def table(runs: list[Run]) -> str:
    head = (f"{'regime':<8}{'method':<14}{'mode':<13}{'GPUs':>5}{'batch/GPU':>10}{'step ms':>9}"
            f"{'img/s':>8}{'epoch s':>9}{'speed-up':>10}{'predicted':>11}")
    lines = [head]  # epoch s: the 50,000 training images at this rate
    for r in runs:
        sp = f"{r.speedup:>9.2f}x" if r.speedup else f"{'':>10}"
        pr = f"{r.predicted:>10.2f}x" if r.predicted else ""
        lines.append(f"{r.regime:<8}{r.method:<14}{r.mode:<13}{r.gpus:>5}{r.per_gpu_batch:>10}"
                     f"{r.step_ms:>9.2f}{r.images_per_s:>8.0f}{r.epoch_s:>9.2f}{sp}{pr}")
    return "\n".join(lines)


def plot(runs: list[Run], title: str):
    """Speed-up of each multi-GPU run over the best single GPU, by regime and GPU count."""
    import matplotlib.pyplot as plt

    multi = [r for r in runs if r.regime != "single"]
    groups = sorted({(r.regime, r.gpus) for r in multi}, key=lambda g: (g[0] != "strong", g[1]))
    kinds = sorted({(r.method, r.mode) for r in multi}, reverse=True)
    fig, ax = plt.subplots(figsize=(8, 3.6))
    width = 0.8 / len(kinds)
    predicted_label = "predicted (no overlap)"  # on the first tick drawn, whichever run it is
    for k, (method, mode) in enumerate(kinds):
        for g, (regime, gpus) in enumerate(groups):
            r = next((r for r in multi if (r.regime, r.gpus, r.method, r.mode)
                      == (regime, gpus, method, mode)), None)
            if r is None:
                continue
            x = g + (k - (len(kinds) - 1) / 2) * width
            ax.bar(x, r.speedup, width, color=f"C{k}",
                   label=f"{method}, {mode}" if g == 0 else None)
            if r.predicted:
                ax.plot(x, r.predicted, "k_", ms=12, mew=2, label=predicted_label)
                predicted_label = None
    for g, (_, gpus) in enumerate(groups):
        ax.hlines(gpus, g - 0.45, g + 0.45, colors="grey", linestyles=":",
                  label="perfect scaling" if g == 0 else None)
    ax.set_xticks(range(len(groups)), [f"{regime}\n{gpus} GPUs" for regime, gpus in groups])
    ax.set_ylabel("speed-up over the best 1-GPU run")
    ax.set_title(title, fontsize=9)
    legend_outside(ax, fontsize=7)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="wrn-28-10")
    parser.add_argument("--gpus", type=int, nargs="+", default=[max(gpu_count(), 2)],
                        help="GPU counts to scale to, e.g. 2 4 8")
    parser.add_argument("--global-batch", type=int, default=128, help="strong scaling")
    parser.add_argument("--per-gpu-batch", type=int, default=128, help="weak scaling")
    parser.add_argument("--modes", nargs="+", choices=[*MODES, STEP_GRAPH],
                        default=[*MODES, STEP_GRAPH])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--no-data-parallel", action="store_true", help="skip nn.DataParallel")
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args(argv)
    modes = tuple(args.modes)
    if gpu_count() == 0 and set(modes) & set(GPU_ONLY_MODES):
        print("no GPU: the CUDA-graph runs are skipped")
        modes = tuple(m for m in modes if m not in GPU_ONLY_MODES) or ("eager",)
    try:
        runs = run(args.model, args.gpus, args.global_batch, args.per_gpu_batch, modes,
                   args.repeats, data_parallel=not args.no_data_parallel)
    except (ValueError, NotEnoughGPUsError) as err:
        parser.error(str(err))
    print(table(runs))
    print("\npredicted: DDP with no overlap of compute and all-reduce (chapter 4's model)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([asdict(r) for r in runs], indent=1))


if __name__ == "__main__":
    main()
