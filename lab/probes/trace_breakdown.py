"""Probe (not part of the book): where the GPU time of a profiled training step goes.

    python scripts/probes/trace_breakdown.py STEPS TRACE.json[.gz] [TRACE ...]

Reads Chrome traces written by ``python -m lab.step_timing --trace``
(``STEPS`` profiled steps each, 5 there) and prints per step: the period (first GPU event to
last, divided by ``STEPS``); the GPU time of all kernels that are not communication, summed
(forward, backward, optimizer, DDP's bucket copies); the GPU time of communication (NCCL's
kernels; for GradBuckets' copy-engine transport, the copy engines' transfers and symmetric
memory's barrier kernels), and the part of it during which nothing else ran (exposed); and the
time with nothing running at all (idle).
Comparing a one-GPU trace with a two-GPU one splits the DDP step's extra time into work that
got slower beside NCCL and communication that nothing hid. A second table gives the GPU time
per step by kind of kernel: convolutions and matrix products (cuDNN, cuBLAS), torch.compile's
Triton kernels (BatchNorm, ReLU and other fused element-wise work), copies, the optimizer,
eager element-wise kernels (such as DDP's scaling of each gradient by 1/world size), NCCL,
copy-engine transfers (``dma``: every ``gpu_memcpy`` event) and symmetric-memory barriers.
"""

import gzip
import json
import sys
from pathlib import Path


def gpu_events(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    return [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy",
                                                                          "gpu_memset")]


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def overlap(spans: list[tuple[float, float]], busy: list[tuple[float, float]]) -> float:
    """Time of ``spans`` covered by the merged intervals ``busy``."""
    total = 0.0
    for a, b in spans:
        for c, d in busy:
            total += max(0.0, min(b, d) - max(a, c))
    return total


KINDS = {  # first match wins, on the lower-cased kernel name
    "nccl": ("nccl",),
    "barrier": ("barrier_kernel",),
    "triton": ("triton",),  # before the others: its names carry the fused ops ("convolution")
    "conv/gemm": ("xmma", "sm90", "gemm", "cudnn", "conv"),
    "copy": ("memcpy", "copy"),
    "optimizer": ("multi_tensor", "sgd"),
    "elementwise": ("elementwise",),
}


COMMUNICATION = ("nccl", "barrier", "dma")


def kind(event: dict) -> str:
    if event["cat"] == "gpu_memcpy":
        return "dma"  # done by a copy engine, not by the multiprocessors
    name = event["name"].lower()
    return next((k for k, marks in KINDS.items() if any(m in name for m in marks)), "other")


def by_kind(path: Path, steps: int) -> dict[str, float]:
    totals = dict.fromkeys([*KINDS, "dma", "other"], 0.0)  # same order as the table
    for e in gpu_events(path):
        totals[kind(e)] += e["dur"] * 1e-3 / steps
    return totals


def breakdown(path: Path, steps: int) -> dict[str, float]:
    events = gpu_events(path)
    spans = {True: [], False: []}  # is communication -> [(start, end)]
    for e in events:
        spans[kind(e) in COMMUNICATION].append((e["ts"], e["ts"] + e["dur"]))
    other_busy = merged(spans[False])
    start = min(a for a, _ in spans[True] + spans[False])
    end = max(b for _, b in spans[True] + spans[False])
    comm_us = sum(b - a for a, b in spans[True])
    any_busy_us = sum(b - a for a, b in merged(spans[True] + spans[False]))
    ms = 1e-3 / steps
    return {"period": (end - start) * ms,
            "kernels": sum(b - a for a, b in spans[False]) * ms,
            "comm": comm_us * ms,
            "exposed": (comm_us - overlap(spans[True], other_busy)) * ms,
            "idle": (end - start - any_busy_us) * ms}


steps = int(sys.argv[1])
paths = [Path(name) for name in sys.argv[2:]]
columns = ("period ms", "kernels ms", "comm ms", "exposed ms", "idle ms")
print(f"{'trace':<44}" + "".join(f"{c:>12}" for c in columns))
for path in paths:
    print(f"{path.name:<44}" + "".join(f"{v:>12.3f}" for v in breakdown(path, steps).values()))
kinds = [*KINDS, "dma", "other"]
print(f"\nGPU ms per step by kind\n{'trace':<44}" + "".join(f"{k:>12}" for k in kinds))
for path in paths:
    print(f"{path.name:<44}" + "".join(f"{v:>12.3f}" for v in by_kind(path, steps).values()))
