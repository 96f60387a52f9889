"""Under torchrun (2 processes, gloo): the training entry point, where rank 1 alone goes bad.

    torchrun --nproc_per_node=2 tests/workers/nan_on_rank1.py <train options>

Before its third step, rank 1 puts a NaN into one weight: its loss is not finite from step 3
on; rank 0's only from step 4, once the all-reduce has carried the NaN into every gradient.
"""

import os
import sys

import torch

from tutorial_utils import train
from tutorial_utils.trainer import Trainer

real = Trainer._forward_backward
calls = []


def nan_on_rank1(self, x, y):
    calls.append(1)
    if self.ctx.rank == 1 and len(calls) == 3:
        with torch.no_grad():
            weight = next(self.net.parameters())
            weight[(0,) * weight.dim()] = float("nan")
    return real(self, x, y)


Trainer._forward_backward = nan_on_rank1
assert os.environ["WORLD_SIZE"] == "2"
sys.exit(train.main(sys.argv[1:]))
