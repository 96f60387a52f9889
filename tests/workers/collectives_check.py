"""Under torchrun (gloo or NCCL): the hand-written all-reduces against ``dist.all_reduce``.

Every rank builds different data; rank 0 writes one JSON line per (algorithm, length, dtype)
with the largest difference from ``dist.all_reduce``, to the path given as the only argument.
Lengths include ones the number of ranks does not divide, and one smaller than a chunk each.
"""

import json
import sys

import torch
import torch.distributed as dist

from tutorial_utils.parallel.collectives import ring_all_reduce
from tutorial_utils.parallel.distributed import distributed
from tutorial_utils.solutions.ch03b import root_all_reduce

with distributed("cpu") as ctx:
    rows = []
    for algorithm in (ring_all_reduce, root_all_reduce):
        for numel in (ctx.world_size, 1001, 4096):
            for dtype in (torch.float32, torch.int64):
                gen = torch.Generator().manual_seed(ctx.rank * 100 + numel)
                x = (torch.randn(numel, generator=gen) * 100).to(dtype)
                expected = x.clone()
                dist.all_reduce(expected)
                got = algorithm(x.clone()).double()
                rows.append({"algorithm": algorithm.__name__, "numel": numel, "dtype": str(dtype),
                             "max_diff": (got - expected.double()).abs().max().item()})
    if ctx.is_main:
        with open(sys.argv[1], "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
