"""Probe: does an NCCL all-reduce that one rank never joins raise on the host?

    torchrun --standalone --nproc_per_node=2 scripts/probes/nccl_hang.py sync|async [warm-up]

sync: dist.all_reduce(t); async: async_op=True, then work.wait(timeout=10 s). With warm-up,
both ranks first complete one all-reduce (NCCL connects peers at the first collective).
"""
import datetime, os, sys, time
import torch, torch.distributed as dist
mode, warm_up = sys.argv[1], sys.argv[2:] == ["warm-up"]
rank = int(os.environ["RANK"]); dev = torch.device("cuda", rank); torch.cuda.set_device(dev)
dist.init_process_group("nccl", device_id=dev, timeout=datetime.timedelta(seconds=10))
print(mode, rank, "init done", os.environ.get("TORCH_NCCL_BLOCKING_WAIT"), flush=True)
if warm_up:
    dist.all_reduce(torch.ones(1, device=dev)); torch.cuda.synchronize()
    print(rank, "warm-up done", flush=True)
t0 = time.time()
if rank == 1:
    time.sleep(40); print("rank1 exiting", flush=True); os._exit(0)
t = torch.ones(1, device=dev)
try:
    if mode == "sync":
        dist.all_reduce(t)
    else:
        w = dist.all_reduce(t, async_op=True)
        print("enqueued", round(time.time() - t0, 1), flush=True)
        w.wait(timeout=datetime.timedelta(seconds=10))
    print("returned after", round(time.time() - t0, 1), flush=True)
    torch.cuda.synchronize(); print("synced", round(time.time() - t0, 1), flush=True)
except Exception as e:
    print("raised after", round(time.time() - t0, 1), type(e).__name__, str(e)[:300], flush=True)
    os._exit(1)
