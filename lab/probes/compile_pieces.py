"""Probe (not part of the book): chapter 5b's copy-engine step with the network in fewer pieces.

    python scripts/probes/compile_pieces.py OUT.jsonl [BUDGET_S [JOB ...]]

For its gradients to come out during backward, the copy-engine step (``GradBuckets`` +
``AveragingSGD``, bf16 rows) compiles WRN-28-10 child by child: 15 pieces, where one GPU's
reference compiles it whole. JOB is ``pair@BATCH`` (the one-GPU step graph, compiled whole,
started on both GPUs at once) or ``PIECES@BATCH`` (the two-GPU copy-engine step with the
network in the pieces that scripts/probes/pieces_step.py names: ``children``, ``groups``,
``groups4``). No job starts after BUDGET_S seconds (default 400). Speed-ups are against the
best one-GPU run at 128 of the invocation (strong: 2 x 64; weak: 2 x 128).
"""

import os
import sys
import time
from pathlib import Path

from cudnn_picks import keep, pair, two_gpus  # this directory's probe: the same runs

HELPER = str(Path(__file__).with_name("pieces_step.py"))

out_path = Path(sys.argv[1])
budget_s = float(sys.argv[2]) if len(sys.argv) > 2 else 400
jobs = sys.argv[3:] or ["pair@128", "children@64", "groups@64", "children@128", "groups@128"]
t0 = time.perf_counter()
rows = []
for job in jobs:
    kind, batch = job.split("@")
    batch = int(batch)
    if time.perf_counter() - t0 > budget_s:
        print(f"{job}: not started, budget spent", flush=True)
        continue
    try:
        if kind == "pair":
            recs = pair(batch, "benchmark")
        else:
            os.environ["PIECES"] = kind
            recs = [two_gpus(batch, "benchmark", HELPER)]
    except Exception as err:  # one failed job must not lose the others
        print(f"{job}: failed: {str(err)[-300:]}", flush=True)
        continue
    for rec in recs:
        keep({**rec, "job": job}, rows, out_path, f"{job} gpu {rec['gpu']}", t0)

ref = min((r["ddp_ms"] for r in rows if r["job"] == "pair@128"), default=None)
print(f"\nbest one GPU at 128: {ref}")
print(f"{'job':<16}{'gpu':>5}{'step ms':>9}{'no_sync':>9}{'speed-up':>10}")
for r in rows:
    sp = ""
    if ref and r["gpu"] == "0+1":
        sp = f"{2 * r['per_gpu_batch'] / r['ddp_ms'] / (128 / ref):>9.3f}x"
    print(f"{r['job']:<16}{r['gpu']:>5}{r['ddp_ms']:>9.2f}{r['no_sync_ms']:>9.2f}{sp}")
print(f"probe done at {time.perf_counter() - t0:.0f} s")
