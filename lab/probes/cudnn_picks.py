"""Probe (not part of the book): how much cuDNN's choice of convolution algorithms moves a step.

    python scripts/probes/cudnn_picks.py OUT.jsonl [BUDGET_S [JOB ...]]

With ``cudnn.benchmark`` each process times cuDNN's candidate algorithms once per shape and
keeps the fastest; one timing each is noisy, so two processes can keep different ones. JOB is
``pair:CUDNN@BATCH`` (the one-GPU step graph of chapter 5b started on both GPUs at once, two
independent picks) or ``ddp2:CUDNN@BATCH`` (the two-GPU copy-engine step of chapter 5b's
"copy engine" row), with CUDNN one of step_timing's ``--cudnn`` choices. No job starts after
BUDGET_S seconds (default 480). The table gives each run's step time.
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tutorial_utils.bench_scaling import COPY_ENGINE_FLAGS
from tutorial_utils.launch import torchrun

BASE = ["--model", "wrn-28-10", "--compile", "default", "--capture", "--optimizer", "fused",
        "--device", "cuda", "--repeats", "30"]


def single(gpu: int, batch: int, cudnn: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "st.jsonl"
        cmd = [sys.executable, "-m", "lab.step_timing", *BASE, "--batch",
               str(batch), "--cudnn", cudnn, "--out", str(out)]
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu)}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        if done.returncode:
            raise RuntimeError(done.stderr[-400:])
        return {**json.loads(out.read_text().splitlines()[0]), "gpu": gpu}


def two_gpus(batch: int, cudnn: str,
             target: str = "lab.step_timing") -> dict:
    """The copy-engine step on 2 GPUs; ``target`` a module or script with step_timing's CLI."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "st.jsonl"
        result = torchrun(target,
                          [*BASE, "--batch", str(batch), "--cudnn", cudnn, "--out", str(out),
                           *COPY_ENGINE_FLAGS], nproc=2, timeout_s=300, metrics_file=out,
                          echo=False)
    return {**result.metrics[0], "gpu": "0+1"}


def pair(batch: int, cudnn: str) -> list[dict]:
    """The one-GPU step started on both GPUs at once: two runs, two independent picks."""
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(single, (0, 1), (batch, batch), (cudnn, cudnn)))


def keep(rec: dict, rows: list[dict], out_path: Path, label: str, t0: float) -> None:
    """Add ``rec`` to ``rows`` and to the JSON lines at ``out_path``; print its step time."""
    rows.append(rec)
    with open(out_path, "a") as f:
        f.write(json.dumps(rec) + "\n")
    print(f"{label}: {rec['ddp_ms']:.2f} ms (no_sync {rec['no_sync_ms']:.2f}) "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)


def main() -> None:
    out_path = Path(sys.argv[1])
    budget_s = float(sys.argv[2]) if len(sys.argv) > 2 else 480
    jobs = sys.argv[3:] or ["pair:benchmark@128", "pair:heuristics@128"]
    t0 = time.perf_counter()
    rows = []
    for job in jobs:
        kind, rest = job.split(":")
        cudnn, batch = rest.split("@")
        if time.perf_counter() - t0 > budget_s:
            print(f"{job}: not started, budget spent", flush=True)
            continue
        try:
            recs = pair(int(batch), cudnn) if kind == "pair" else [two_gpus(int(batch), cudnn)]
        except Exception as err:  # one failed job must not lose the others
            print(f"{job}: failed: {str(err)[-300:]}", flush=True)
            continue
        for rec in recs:
            keep({**rec, "job": job}, rows, out_path, f"{job} gpu {rec['gpu']}", t0)

    print(f"\n{'job':<26}{'gpu':>5}{'step ms':>9}{'no_sync':>9}")
    for r in rows:
        print(f"{r['job']:<26}{r['gpu']:>5}{r['ddp_ms']:>9.2f}{r['no_sync_ms']:>9.2f}")
    print(f"probe done at {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
