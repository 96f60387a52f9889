"""Under torchrun (gloo, 2 processes): how many all-reduces one step of each split runs.

Rank 0 writes one JSON line per mode to the path given as the only argument: the all-reduces
of the forward and of the backward pass, for a GPT of ``LAYERS`` blocks.
"""

import copy
import sys
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode

from tutorial_utils.jsonl import write_jsonl
from tutorial_utils.models.gpt import GPT, GPTConfig, lm_loss
from tutorial_utils.parallel.distributed import distributed
from tutorial_utils.parallel.tensor import split_by_hand, tensor_parallel

LAYERS = 3


def by_hand(model, x):
    with mock.patch.object(dist, "all_reduce", wraps=dist.all_reduce) as calls:
        loss = lm_loss(model(x), x)
        forward = calls.call_count
        loss.backward()
    return forward, calls.call_count - forward


def all_reduces(comm: CommDebugMode) -> int:
    return sum(n for op, n in comm.get_comm_counts().items() if "all_reduce" in str(op))


def with_dtensors(model, x):
    with CommDebugMode() as comm:
        loss = lm_loss(model(x), x)
    forward = all_reduces(comm)
    with CommDebugMode() as comm:
        loss.backward()
    return forward, all_reduces(comm)


with distributed("cpu") as ctx:
    torch.manual_seed(0)
    base = GPT(GPTConfig(seq=16, layers=LAYERS, heads=2, dim=32))
    x = torch.randint(0, 256, (2, 16))
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    rows = []
    for mode, count in (("by-hand", lambda: by_hand(split_by_hand(copy.deepcopy(base)), x)),
                        ("parallelize_module", lambda: with_dtensors(
                            tensor_parallel(copy.deepcopy(base), mesh), x))):
        forward, backward = count()
        rows.append({"mode": mode, "layers": LAYERS, "forward": forward, "backward": backward})
    if ctx.is_main:
        write_jsonl(Path(sys.argv[1]), rows)
