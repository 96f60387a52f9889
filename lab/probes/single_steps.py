"""Probe (not part of the book): one GPU's WRN-28-10 step, eager and with CUDA graphs, and the
host time to queue it, at the batch sizes given.

    python scripts/probes/single_steps.py 64 128
"""
import json
import sys

import torch

from tutorial_utils.bench_data_parallel import measure_single
from tutorial_utils.bench_one_gpu import LADDER, LadderSize

for batch in map(int, sys.argv[1:]):
    for rung in (LADDER[3], LADDER[-1]):
        torch.compiler.reset()  # a fresh compilation per size, as the benchmark does
        r = measure_single(rung, LadderSize("wrn-28-10", batch, 5, 20), torch.device("cuda"))
        print(json.dumps({"batch": batch, "rung": rung.name,
                          "step_ms": round(r.timing.median_ms, 2),
                          "host_ms": round(r.host_ms, 2)}), flush=True)
