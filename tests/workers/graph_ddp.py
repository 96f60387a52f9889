"""Under torchrun: DDP steps replayed from one CUDA graph equal eager DDP steps on every rank.

Each rank trains on its own data, so the ranks' weights agree only if the captured all-reduce
really runs on every replay. Prints "graph_ddp ok" from rank 0.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tutorial_utils.parallel.distributed import distributed
from tutorial_utils.step_graph import StepGraph

with distributed("cuda") as ctx:
    dev = ctx.device
    gen = torch.Generator(device=dev).manual_seed(ctx.rank)
    batches = [(torch.randn(32, 8, device=dev, generator=gen),
                torch.randint(0, 4, (32,), device=dev, generator=gen)) for _ in range(4)]
    weights = []
    for capture in (False, True):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 4))
        with StepGraph(dev, enabled=capture) as graph:
            with graph.stream():
                model = DDP(net.to(dev), device_ids=[dev.index])
            # Stepped inside the graph: a tensor lr that the fused kernel reads on the GPU.
            opt = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.1, device=dev),
                                  momentum=0.9, fused=True)
            x, y = (t.clone() for t in batches[0])

            def body(model=model, opt=opt, x=x, y=y):
                F.cross_entropy(model(x), y).backward()
                opt.step()

            step = graph.capture(body, net, opt)  # warm-up on batch 0, then state restored
            for bx, by in batches:
                x.copy_(bx)
                y.copy_(by)
                step()
            torch.cuda.synchronize(dev)
            params = torch.cat([p.detach().flatten() for p in net.parameters()])
            stats = torch.cat([b.flatten() for b in net.buffers() if b.is_floating_point()])
            weights.append((params, stats))
    (eager, eager_stats), (graphed, graphed_stats) = weights
    torch.testing.assert_close(graphed, eager)
    # BatchNorm's running statistics come from each rank's own batch: equal to eager, but
    # not across ranks.
    torch.testing.assert_close(graphed_stats, eager_stats)
    everyone = [torch.empty_like(graphed) for _ in range(ctx.world_size)]
    dist.all_gather(everyone, graphed)
    for other in everyone[1:]:
        torch.testing.assert_close(other, everyone[0], rtol=0, atol=0)
    if ctx.is_main:
        print("graph_ddp ok", flush=True)
