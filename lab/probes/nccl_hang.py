"""Probe: does an NCCL all-reduce that one rank never joins raise on the host?

    torchrun --standalone --nproc_per_node=2 scripts/probes/nccl_hang.py sync|async [warm-up]

sync: dist.all_reduce(t); async: async_op=True, then work.wait(timeout=10 s). With warm-up,
both ranks first complete one all-reduce (NCCL connects peers at the first collective).
"""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist


def log(*parts) -> None:
    print(*parts, flush=True)


mode, warm_up = sys.argv[1], sys.argv[2:] == ["warm-up"]
rank = int(os.environ["RANK"])
dev = torch.device("cuda", rank)
torch.cuda.set_device(dev)
dist.init_process_group("nccl", device_id=dev, timeout=datetime.timedelta(seconds=10))
log(mode, rank, "init done", os.environ.get("TORCH_NCCL_BLOCKING_WAIT"))
if warm_up:
    dist.all_reduce(torch.ones(1, device=dev))
    torch.cuda.synchronize()
    log(rank, "warm-up done")
t0 = time.time()
if rank == 1:  # never joins the all-reduce below
    time.sleep(40)
    log("rank1 exiting")
    os._exit(0)
t = torch.ones(1, device=dev)
try:
    if mode == "sync":
        dist.all_reduce(t)
    else:
        work = dist.all_reduce(t, async_op=True)
        log("enqueued", round(time.time() - t0, 1))
        work.wait(timeout=datetime.timedelta(seconds=10))
    log("returned after", round(time.time() - t0, 1))
    torch.cuda.synchronize()
    log("synced", round(time.time() - t0, 1))
except Exception as err:
    log("raised after", round(time.time() - t0, 1), type(err).__name__, str(err)[:300])
    os._exit(1)
