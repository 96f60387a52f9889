"""Probe (not part of the book): one GPU's WRN-28-10 step under kernel-level settings.

    python scripts/probes/compile_modes.py OUT.jsonl [BUDGET_S [VARIANT ...]]

Each variant is ``python -m lab.step_timing`` in one process (no DDP) at 64
and 128 images: eager, and the whole step as one CUDA graph (``--capture``) with the network
compiled — the step graph of chapter 5b — with SGD as a few multi-tensor kernels (foreach) or
one pass per tensor (fused), and with Inductor's tuning of its own kernels (coordinate descent
over block sizes; ``max-autotune-no-cudagraphs``, which also times Triton templates against
cuDNN's convolutions and cuBLAS's matrix products). The runs share out the GPUs present, one
run per GPU at a time; none starts after BUDGET_S seconds (default 480). The table gives each
step's time and the speed-up over eager at the same batch.
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from queue import Queue

import torch

GRAPH = ["--capture", "--compile", "default"]
# name: step_timing flags
VARIANTS = {
    "eager": ["--compile", "none"],
    "graph": GRAPH,
    "graph+fused": [*GRAPH, "--optimizer", "fused"],
    "graph+fused+coord": [*GRAPH, "--optimizer", "fused", "--tune-kernels"],
    "graph+fused+autotune": ["--capture", "--compile", "max-autotune-no-cudagraphs",
                             "--optimizer", "fused"],
}


def step_timing(gpu: int, batch: int, flags: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "st.jsonl"
        cmd = [sys.executable, "-m", "lab.step_timing", "--model",
               "wrn-28-10", "--batch", str(batch), "--device", "cuda", "--repeats", "30",
               "--out", str(out), *flags]
        run_env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu)}
        done = subprocess.run(cmd, env=run_env, capture_output=True, text=True, timeout=360)
        if done.returncode:
            raise RuntimeError(done.stderr[-400:])
        return json.loads(out.read_text().splitlines()[0])


out_path = Path(sys.argv[1])
budget_s = float(sys.argv[2]) if len(sys.argv) > 2 else 480
chosen = sys.argv[3:] or list(VARIANTS)
jobs = [(name, batch) for name in chosen for batch in (64, 128)]
if not torch.cuda.is_available():
    sys.exit("compile_modes.py times CUDA graphs: run it on a machine with a GPU")
gpus: Queue = Queue()
for g in range(torch.cuda.device_count()):
    gpus.put(g)
t0 = time.perf_counter()


def run(job: tuple[str, int]) -> dict | None:
    name, batch = job
    if time.perf_counter() - t0 > budget_s:
        print(f"{name}@{batch}: not started, budget spent", flush=True)
        return None
    gpu = gpus.get()
    started = time.perf_counter()
    try:
        rec = step_timing(gpu, batch, VARIANTS[name]) | {"variant": name}
    except Exception as err:  # one failed variant must not lose the others
        print(f"{name}@{batch}: failed: {str(err)[-300:]}", flush=True)
        return None
    finally:
        gpus.put(gpu)
    print(f"{name}@{batch}: {rec['ddp_ms']:.2f} ms (GPU {gpu}, "
          f"{time.perf_counter() - started:.0f} s with compilation)", flush=True)
    with open(out_path, "a") as f:
        f.write(json.dumps(rec) + "\n")
    return rec


with ThreadPoolExecutor(gpus.qsize()) as pool:
    rows = [r for r in pool.map(run, jobs) if r]
eager = {r["per_gpu_batch"]: r["ddp_ms"] for r in rows if r["variant"] == "eager"}
print(f"\n{'variant':<24}{'batch':>6}{'step ms':>9}{'host ms':>9}{'vs eager':>9}")
for r in sorted(rows, key=lambda r: (r["per_gpu_batch"], chosen.index(r["variant"]))):
    b = r["per_gpu_batch"]
    ratio = f"{eager[b] / r['ddp_ms']:8.2f}x" if b in eager else f"{'-':>9}"
    print(f"{r['variant']:<24}{b:>6}{r['ddp_ms']:>9.2f}{r['host_ms']:>9.2f}{ratio}")
