"""Under torchrun (gloo): what each FSDP2 unit holds between forward and backward.

For ZeRO-3 (``reshard_after_forward=True``) and the ZeRO-2-like mode (False), rank 0 writes one
JSON line per mode to the path given as the only argument: how many parameters of the
residual blocks are sharded DTensors after the forward, and how many elements this rank holds
of them then, against the whole blocks' size.
"""

import json
import sys

import torch
from torch.distributed.tensor import DTensor

from tutorial_utils.models.wrn import BasicBlock, wide_resnet
from tutorial_utils.parallel.distributed import distributed
from tutorial_utils.parallel.fsdp import shard

with distributed("cpu") as ctx:
    rows = []
    for reshard in (True, False):
        torch.manual_seed(0)
        model = wide_resnet("wrn-10-1")
        full = sum(p.numel() for m in model if isinstance(m, BasicBlock) for p in m.parameters())
        model = shard(model, ctx, units="block", reshard_after_forward=reshard)
        loss = model(torch.randn(4, 3, 32, 32)).sum()  # forward done, backward not begun
        params = [p for m in model if isinstance(m, BasicBlock) for p in m.parameters()]
        held = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params)
        rows.append({"reshard_after_forward": reshard, "params": len(params),
                     "sharded": sum(isinstance(p, DTensor) for p in params),
                     "held": held, "full": full})
        loss.backward()
    if ctx.is_main:
        with open(sys.argv[1], "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
