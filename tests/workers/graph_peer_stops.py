"""Under torchrun: rank 1 stops replaying its graph; rank 0's StepGraph watchdog ends the job.

The all-reduce in rank 0's next replay waits for a peer that never comes, and NCCL's own
watchdog does not see collectives replayed from a graph: without StepGraph's, rank 0 would
wait for ever (here, until rank 1 wakes after 300 s).
"""

import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tutorial_utils.parallel.distributed import distributed
from tutorial_utils.step_graph import StepGraph

with distributed("cuda") as ctx:
    dev = ctx.device
    net = nn.Linear(8, 4).to(dev)
    x, y = torch.randn(16, 8, device=dev), torch.randint(0, 4, (16,), device=dev)
    with StepGraph(dev, timeout_s=5) as graph:
        with graph.stream():
            model = DDP(net, device_ids=[dev.index])
        opt = torch.optim.SGD(net.parameters(), lr=0.1)  # stepped outside: a float will do
        step = graph.capture(lambda: F.cross_entropy(model(x), y).backward(), net, opt)
        for _ in range(3):
            step()
        torch.cuda.synchronize(dev)
        print(f"rank {ctx.rank}: replays run", flush=True)
        if ctx.rank == 1:
            time.sleep(300)  # a peer that stops replaying (a stuck data loader, say)
        step()
        torch.cuda.synchronize(dev)
        print(f"rank {ctx.rank}: the replay without its peer finished", flush=True)
