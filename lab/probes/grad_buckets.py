"""Probe (not part of the book): DDP against the hand-built GradBuckets, step graph, 2 GPUs.

    python scripts/probes/grad_buckets.py OUT.jsonl [BUDGET_S [VARIANT@BATCH ...]]

GradBuckets runs with either transport: all-reduces (``buckets*``) or copy-engine pulls
(``copy-engine*``).

Every run is ``python -m lab.step_timing --capture --compile default
--optimizer fused`` (chapter 5b's step graph, SGD as in ``train``) plus the variant's flags.
The one-GPU references run first, side by side (one per GPU): the network compiled whole (as
in chapter 5b) and compiled child by child (as GradBuckets needs it), at 64 and 128 images.
Then the two-GPU variants run one after the other; none starts after BUDGET_S seconds
(default 480). The table gives each step, the compute alone (``no_sync``) and the speed-up
over the best one-GPU run: at the same batch for 128 per GPU (weak scaling), at 128 for 64 per
GPU (the post's batch of 128 split over two GPUs).
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tutorial_utils.launch import torchrun

BASE = ["--model", "wrn-28-10", "--compile", "default", "--capture", "--optimizer", "fused",
        "--device", "cuda", "--repeats", "30"]
SINGLE = {"whole": [], "children": ["--grad-sync", "buckets"]}  # one process: no hooks at all
VARIANTS = {
    "ddp": [],
    "buckets": ["--grad-sync", "buckets"],
    "buckets-50MB": ["--grad-sync", "buckets", "--bucket-mb", "50"],
    "buckets-10MB": ["--grad-sync", "buckets", "--bucket-mb", "10"],
    "buckets-bf16": ["--grad-sync", "buckets", "--bf16-grads"],  # half the bytes on the wire
    "copy-engine": ["--grad-sync", "copy-engine"],  # no NCCL kernels: DMA copies + additions
    "copy-engine-bf16": ["--grad-sync", "copy-engine", "--bf16-grads"],
    "copy-engine-bf16-10MB": ["--grad-sync", "copy-engine", "--bf16-grads", "--bucket-mb", "10"],
    # the averaging left to the optimizer's own pass (AveragingSGD): no kernels beside backward
    "copy-engine-avg": ["--grad-sync", "copy-engine", "--optimizer", "averaging"],
    "copy-engine-avg-bf16": ["--grad-sync", "copy-engine", "--optimizer", "averaging",
                             "--bf16-grads"],
}


def single(gpu: int, batch: int, flags: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "st.jsonl"
        cmd = [sys.executable, "-m", "lab.step_timing", *BASE, "--batch",
               str(batch), "--out", str(out), *flags]
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu)}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        if done.returncode:
            raise RuntimeError(done.stderr[-400:])
        return json.loads(out.read_text().splitlines()[0])


def two_gpus(batch: int, flags: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "st.jsonl"
        result = torchrun("lab.step_timing",
                          [*BASE, "--batch", str(batch), "--out", str(out), *flags], nproc=2,
                          timeout_s=300, metrics_file=out, echo=False)
    return result.metrics[0]


out_path = Path(sys.argv[1])
budget_s = float(sys.argv[2]) if len(sys.argv) > 2 else 480
chosen = sys.argv[3:] or ["ddp@128", "buckets@128", "ddp@64", "buckets@64"]
t0 = time.perf_counter()
singles: dict[tuple[str, int], dict] = {}
jobs = [(name, b) for name in SINGLE for b in (64, 128)]
for two_jobs in (jobs[:2], jobs[2:]):  # side by side, one per GPU
    with ThreadPoolExecutor(2) as pool:
        running = {job: pool.submit(single, gpu, job[1], SINGLE[job[0]])
                   for gpu, job in enumerate(two_jobs)}
    for job, future in running.items():
        singles[job] = future.result()
        print(f"one GPU, {job[0]} @ {job[1]}: {singles[job]['ddp_ms']:.2f} ms", flush=True)
rows = []
for run in chosen:
    name, batch = run.split("@")
    if time.perf_counter() - t0 > budget_s:
        print(f"{run}: not started, budget spent", flush=True)
        continue
    try:
        rec = two_gpus(int(batch), VARIANTS[name])
    except Exception as err:  # one failed variant must not lose the others
        print(f"{run}: failed: {str(err)[-300:]}", flush=True)
        continue
    rec["variant"] = name
    rows.append(rec)
    with open(out_path, "a") as f:
        f.write(json.dumps(rec) + "\n")
    print(f"{run}: {rec['ddp_ms']:.2f} ms", flush=True)
with open(out_path, "a") as f:
    for (name, _), rec in singles.items():
        f.write(json.dumps({**rec, "variant": f"one GPU, {name}"}) + "\n")

best = {b: min(singles[(n, b)]["ddp_ms"] for n in SINGLE) for b in (64, 128)}
print(f"\nbest one GPU: 64 -> {best[64]:.2f} ms, 128 -> {best[128]:.2f} ms")
print(f"{'variant':<16}{'batch/GPU':>10}{'step ms':>9}{'no_sync':>9}{'speed-up':>9}")
for r in rows:
    b = r["per_gpu_batch"]
    ref_images = 128  # weak: 2 x 128 against one GPU's 128; strong: 2 x 64 against 128
    speedup = (2 * b / r["ddp_ms"]) / (ref_images / best[128])
    print(f"{r['variant']:<16}{b:>10}{r['ddp_ms']:>9.2f}{r['no_sync_ms']:>9.2f}{speedup:>8.2f}x")
print(f"probe done at {time.perf_counter() - t0:.0f} s")
