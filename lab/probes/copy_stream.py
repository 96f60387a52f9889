"""Probe (not part of the book): GradBuckets' copy into its row on its own stream or not.

    python scripts/probes/copy_stream.py OUT.jsonl [BUDGET_S [ROUNDS]]

Chapter 5b's "copy engine" step (step graph, GradBuckets with the copy-engine transport,
AveragingSGD, bf16 rows) on 2 GPUs at 64 and 128 images per GPU, timed alternately with the
copy of each bucket into this process's row on the transport's stream (``side``, the package)
and on the compute stream (``compute``, scripts/probes/copy_on_compute_stream.py), ROUNDS
times (default 2). The one-GPU step graph at 128 runs first on both GPUs at once, as the
reference of the speed-ups. No run starts after BUDGET_S seconds (default 300).
"""

import sys
import time
from pathlib import Path

from cudnn_picks import keep, pair, two_gpus  # this directory's probe: the same runs

TARGETS = {"side": "lab.step_timing",
           "compute": str(Path(__file__).with_name("copy_on_compute_stream.py"))}


out_path = Path(sys.argv[1])
budget_s = float(sys.argv[2]) if len(sys.argv) > 2 else 300
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2
t0 = time.perf_counter()
refs = [r["ddp_ms"] for r in pair(128, "benchmark")]
best = min(refs)
print(f"one GPU @ 128 (GPU 0, GPU 1): {refs[0]:.2f}, {refs[1]:.2f} ms", flush=True)
rows = []
for r in range(rounds):
    for batch in (64, 128):
        for where in (("side", "compute") if r % 2 == 0 else ("compute", "side")):
            if time.perf_counter() - t0 > budget_s:
                print(f"{where}@{batch}: not started, budget spent", flush=True)
                continue
            rec = {**two_gpus(batch, "benchmark", TARGETS[where]), "copy_stream": where,
                   "round": r}
            # weak: 2 x 128 against one GPU's 128; strong: 2 x 64 against one GPU's 128
            rec["speedup"] = 2 * batch / rec["ddp_ms"] / (128 / best)
            keep(rec, rows, out_path, f"{where}@{batch}", t0)

print(f"\nbest one GPU at 128: {best:.2f} ms")
print(f"{'copy on':<10}{'batch/GPU':>10}{'round':>6}{'step ms':>9}{'no_sync':>9}{'speed-up':>9}")
for r in rows:
    print(f"{r['copy_stream']:<10}{r['per_gpu_batch']:>10}{r['round']:>6}{r['ddp_ms']:>9.2f}"
          f"{r['no_sync_ms']:>9.2f}{r['speedup']:>8.2f}x")
print(f"probe done at {time.perf_counter() - t0:.0f} s")
