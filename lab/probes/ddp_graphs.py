"""Probe (not part of the book): where a DDP step of WRN-28-10 with CUDA graphs loses time.

    [TRACE=trace.json] torchrun --standalone --nproc_per_node=2 scripts/probes/ddp_graphs.py \
        {baseline,no-optimize-ddp,one-graph-view,manual,bucket-view,one-bucket,python-reducer,
         eager} BATCH
"""
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile

from tutorial_utils.models import wide_resnet
from tutorial_utils.timing import benchmark

variant, batch = sys.argv[1], int(sys.argv[2])
rank, ws = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dev = torch.device("cuda", rank)
torch.cuda.set_device(dev)
dist.init_process_group("nccl", device_id=dev)
torch.backends.cudnn.benchmark = True
if variant in ("no-optimize-ddp", "one-graph-view"):
    torch._dynamo.config.optimize_ddp = False
elif variant == "python-reducer":  # backward, all-reduces included, traced as one graph
    torch._dynamo.config.optimize_ddp = "python_reducer"
    torch._dynamo.config.compiled_autograd = True
torch.manual_seed(0)
net = wide_resnet("wrn-28-10").to(dev, memory_format=torch.channels_last)
mode = "none" if variant == "eager" else "reduce-overhead"
inner = net if mode == "none" else torch.compile(net, mode=mode)
if variant == "manual":
    model = inner
else:
    view = variant in ("bucket-view", "one-graph-view")
    model = DDP(inner, device_ids=[rank], gradient_as_bucket_view=view,
                bucket_cap_mb=400 if variant == "one-bucket" else 25)
params = list(net.parameters())
opt = torch.optim.SGD(params, lr=0.01, momentum=0.9, nesterov=True)
x = torch.randn(batch, 3, 32, 32, device=dev).to(memory_format=torch.channels_last)
y = torch.randint(0, 10, (batch,), device=dev)

def step():
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    if variant == "manual":
        grads = [p.grad for p in params]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat)
        for g, f in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
            g.copy_(f)
    opt.step()
    opt.zero_grad(set_to_none=True)

t = benchmark(step, warmup=6, repeats=20, device=dev)
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(5):
        step()
    torch.cuda.synchronize()
ev = prof.key_averages()
nccl = sum(e.self_device_time_total for e in ev if "nccl" in e.key.lower()) / 5e3
total = sum(e.self_device_time_total for e in ev) / 5e3
if rank == 0:
    record = {"variant": variant, "batch": batch, "step_ms": round(t.median_ms, 2),
              "gpu_kernels_ms": round(total - nccl, 2), "nccl_ms": round(nccl, 2)}
    print(json.dumps(record), flush=True)
    if variant == "baseline" or "TRACE" in os.environ:
        prof.export_chrome_trace(os.environ.get("TRACE", "/tmp/trace.json"))
        print(ev.table(sort_by="self_device_time_total", row_limit=12), flush=True)
dist.destroy_process_group()
