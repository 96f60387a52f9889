"""A complete DistributedDataParallel training script, with nothing hidden in helpers.

    torchrun --standalone --nproc_per_node=2 -m tutorial_utils.workers.ddp_minimal --out runs/ddp

Chapter 4 shows this file as it is: the process group and the device of each process, the
model wrapped in DDP, the data sharded with a ``DistributedSampler`` (``set_epoch`` every
epoch), a checkpoint written by rank 0 alone, and a teardown that runs even after an error.
It trains a small CNN on random CIFAR-shaped data so that it runs anywhere in seconds; swap
in your own model and dataset. ``python -m tutorial_utils.train`` is the same skeleton with
the Wide-ResNet, real data, resuming and the speed-ups of chapter 2.
"""

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def setup() -> tuple[int, int, torch.device]:
    """Join the process group torchrun describes in the environment; pin this process's GPU.

    One GPU per process when the machine has one for each of its processes (NCCL); otherwise
    every process computes on the CPU (gloo), so the script also runs on a laptop.
    """
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"]):
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)  # before any CUDA work: nothing lands on GPU 0 by mistake
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return rank, world, device


def train(args: argparse.Namespace, rank: int, device: torch.device) -> list[float]:
    torch.manual_seed(0)  # every rank builds the same data; DDP broadcasts rank 0's weights
    data = TensorDataset(torch.randn(2048, 3, 32, 32), torch.randint(0, 10, (2048,)))
    sampler = DistributedSampler(data, shuffle=True, seed=0)  # a different slice per rank
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler, drop_last=True)
    net = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                        nn.Flatten(), nn.Linear(64, 10)).to(device)
    model = DDP(net, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # without it, every epoch repeats the first epoch's order
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP averages the gradients over the ranks during backward
            optimizer.step()
        losses.append(loss.item())
        if rank == 0:  # one writer; the weights are the same on every rank
            args.out.mkdir(parents=True, exist_ok=True)
            torch.save({"model": net.state_dict(), "epoch": epoch}, args.out / "checkpoint.pt")
        dist.barrier()  # nobody starts the next epoch (or exits) while rank 0 is writing
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64, help="per-process batch")
    parser.add_argument("--out", type=Path, default=Path("runs/ddp_minimal"))
    args = parser.parse_args()
    rank, world, device = setup()
    try:
        losses = train(args, rank, device)
        if rank == 0:
            print(json.dumps({"world_size": world, "device": device.type, "losses": losses}))
    finally:
        dist.destroy_process_group()  # also after an exception: no half-open group is left


if __name__ == "__main__":
    main()
