"""A profiler timeline from a Chrome trace: one row per GPU stream and host thread.

``torch.profiler`` writes Chrome traces (``prof.export_chrome_trace``; chapter 5b's worker
with ``--trace PATH``): a JSON list of events, each with a category, a start ``ts`` and a
duration ``dur`` in microseconds, a process ``pid`` and a thread ``tid``. A GPU kernel's
``pid`` is its device and its ``tid`` its stream; a host event's are the process and thread.
:func:`plot` draws them as bars; :func:`overlap` says, per step, how long communication ran
and how much of it ran beside compute. :func:`profile_steps` makes such a trace inside a
worker; :func:`tutorial_utils.bench.ddp_timing.trace` launches the DDP step's.
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

HOST_OPS, LAUNCHES, GLOO = "host: PyTorch operators", "host: CUDA calls", "gloo collectives"
COMPUTE, NCCL, COPIES = "GPU: compute kernels", "GPU: NCCL kernels", "GPU: copies, memsets"
COLOURS = {HOST_OPS: "0.6", LAUNCHES: "C1", GLOO: "C3", COMPUTE: "C0", NCCL: "C3", COPIES: "C2"}
STEP = re.compile(r"^step \d+$")  # the worker's record_function around each profiled step
# the backend's annotation of each collective it runs: "nccl:all_reduce", "gloo:broadcast"
COLLECTIVE = re.compile(r"^(?:nccl|gloo):(all_reduce|broadcast)")
# A thread the profiler names after the interpreter (python, python3, python3.12) has no
# name of its own; a process's main thread (tid == pid) is labelled as such on any machine.
INTERPRETER = re.compile(r"^python[\d.]*$")


def profile_steps(step, device: torch.device, trace: Path | None, steps: int = 5) -> dict:
    """Profile ``steps`` calls of ``step`` on every rank (their collectives must match); GPU
    milliseconds per step in kernels and in NCCL, and all-reduces (one per DDP bucket) and
    broadcasts launched per step; a rank given ``trace`` writes the trace."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    from ..timing import synchronize

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for i in range(steps):
            with record_function(f"step {i}"):  # marks where each step starts on the host
                step()
        synchronize(device)
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    on_gpu = [e for e in prof.events()
              if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
    nccl = [e for e in on_gpu if "nccl" in e.name.lower()]

    def per_step_ms(events) -> float:
        return sum(e.time_range.elapsed_us() for e in events) / steps / 1e3

    calls = [m.group(1) for e in prof.events() if (m := COLLECTIVE.match(e.name))]
    return {"gpu_kernels_ms": per_step_ms(on_gpu) - per_step_ms(nccl),
            "gpu_nccl_ms": per_step_ms(nccl), "all_reduces": calls.count("all_reduce") / steps,
            "broadcasts": calls.count("broadcast") / steps}


def load(path: Path | str) -> list[dict]:
    """The events of a Chrome trace file (``.json`` or ``.json.gz``)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def category(event: dict) -> str | None:
    """What a complete (``ph == "X"``) event is, as one of the legend's names; None: not drawn."""
    if event.get("ph") != "X" or "dur" not in event:
        return None
    cat, name = event.get("cat", ""), event.get("name", "")
    if cat == "kernel":
        return NCCL if "nccl" in name.lower() else COMPUTE
    if cat in ("gpu_memcpy", "gpu_memset"):
        return COPIES
    if cat in ("cuda_runtime", "cuda_driver"):
        return LAUNCHES
    if cat == "cpu_op":
        return HOST_OPS
    if cat == "user_annotation" and name.startswith("gloo:"):
        return GLOO
    return None


def rows(events: list[dict]) -> dict[str, list[tuple[float, float, str]]]:
    """Row label -> ``(start_us, duration_us, category)`` of its drawn events; host rows first."""
    names: dict[tuple, str] = {}
    for e in (e for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"):
        name = re.sub(r"^thread \d+ \((.+)\)$", r"\1", e["args"]["name"].strip())
        key = (e.get("pid"), e.get("tid"))
        if key not in names or INTERPRETER.match(names[key]):
            names[key] = name  # a thread named twice keeps its own name, not its parent's
    found: dict[tuple, list[tuple[float, float, str]]] = {}
    for e in events:
        cat = category(e)
        if cat is not None:
            gpu = cat in (COMPUTE, NCCL, COPIES)
            found.setdefault((gpu, e.get("pid"), e.get("tid")), []).append((e["ts"], e["dur"], cat))
    out: dict[str, list[tuple[float, float, str]]] = {}
    # Host before GPU; a process's main thread (tid == pid) first; then by number.
    for gpu, pid, tid in sorted(found, key=lambda k: (k[0], f"{k[1]:>12}", k[2] != k[1],
                                                      f"{k[2]:>12}")):
        label = (f"GPU {pid}, stream {tid}" if gpu else "host: main thread" if tid == pid
                 else f"host: {names.get((pid, tid), f'thread {tid}')}")
        same = sum(existing.split(" #")[0] == label for existing in out)  # threads of one name
        out[f"{label} #{same + 1}" if same else label] = found[(gpu, pid, tid)]
    return out


def step_starts(events: list[dict]) -> list[float]:
    """Host start time (us) of each profiled step, from the worker's ``step N`` annotations."""
    return sorted(e["ts"] for e in events if e.get("ph") == "X"
                  and e.get("cat") == "user_annotation" and STEP.match(e.get("name", "")))


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the overlap of two sorted lists of disjoint intervals."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def overlap(events: list[dict]) -> dict[str, float | str]:
    """Per profiled step: ms of communication, of compute, and of the two at once.

    On GPUs communication is NCCL's kernels and compute every other kernel (a kernel counts
    while it is resident, so an NCCL kernel's time includes waiting for the other GPUs); on
    CPU processes they are gloo's collectives and the host's operators. ``exposed_ms`` is
    communication with no compute beside it.
    """
    spans = {c: [(e["ts"], e["ts"] + e["dur"]) for e in events if category(e) == c]
             for c in COLOURS}
    comm, compute = (NCCL, COMPUTE) if spans[COMPUTE] else (GLOO, HOST_OPS)
    a, b = _union(spans[comm]), _union(spans[compute])
    per_step_ms = 1e-3 / max(len(step_starts(events)), 1)
    comm_ms, both_ms = sum(e - s for s, e in a) * per_step_ms, _intersection(a, b) * per_step_ms
    return {"steps": max(len(step_starts(events)), 1), "comm": comm, "comm_ms": comm_ms,
            "compute_ms": sum(e - s for s, e in b) * per_step_ms, "overlap_ms": both_ms,
            "exposed_ms": comm_ms - both_ms,
            "overlap_frac": both_ms / comm_ms if comm_ms else float("nan")}


def plot(events: list[dict], title: str):
    """One row per host thread and GPU stream, time in ms from the first drawn event."""
    return plot_rows(rows(events), step_starts(events), title)


def plot_rows(table: dict[str, list], starts: list[float], title: str):
    """:func:`plot` from what it draws: the spans of each row (:func:`rows`) and the steps'
    starts (:func:`step_starts`), as a record keeps them."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    t0 = min(start for spans in table.values() for start, _, _ in spans)
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(table) + 1.4))
    drawn = set()
    for y, spans in enumerate(table.values()):
        for cat in COLOURS:
            bars = [((s - t0) / 1e3, d / 1e3) for s, d, c in spans if c == cat]
            if bars:
                ax.broken_barh(bars, (y - 0.4, 0.8), color=COLOURS[cat], linewidth=0)
                drawn.add(cat)
    handles = [Patch(color=COLOURS[c], label=c) for c in COLOURS if c in drawn]
    for k, start in enumerate(starts):
        line = ax.axvline((start - t0) / 1e3, color="k", ls=":", lw=0.8)
        if k == 0:
            line.set_label("a step starts (host)")
            handles.append(line)
    ax.set_yticks(range(len(table)), list(table))
    ax.invert_yaxis()
    ax.set_xlabel("time since the first event (ms)")
    ax.set_title(title, fontsize=9)
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    return fig
