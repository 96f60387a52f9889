"""The GPT's training loop under FSDP2 x TP: tensor parallelism inside groups, FSDP2 across.

    torchrun --standalone --nproc_per_node=4 -m tutorial_utils.workers.loop_fsdp2_tp --tp 2

The FSDP2 loop (``loop_fsdp2.py``) on a 2-D mesh: each block split over the ``tp`` ranks of a
group (chapter 7's plan), then sharded over the ``dp`` groups, which take the batch's shares.
"""

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from tutorial_utils.models.gpt import GPT, GPTConfig, lm_loss
from tutorial_utils.parallel.tensor import tensor_parallel
from tutorial_utils.text import batch, stdlib_corpus


def setup() -> tuple[int, int, torch.device]:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"]):
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:  # CPU processes
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return rank, world, device


def build(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial weights in every version
    cfg = GPTConfig(dim=args.dim, layers=args.layers, heads=args.heads, seq=args.seq)
    return GPT(cfg).to(device)


def shard(model: torch.nn.Module, mesh) -> torch.nn.Module:
    for block in model.blocks:  # each block gathered just before it runs, freed after
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)  # the embedding, final norm and output layer


def train(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> list[float]:
    mesh = init_device_mesh(device.type, (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    model = shard(tensor_parallel(build(args, device), mesh["tp"]), mesh["dp"])
    rank, world = mesh["dp"].get_local_rank(), mesh["dp"].size()  # the batch splits over dp
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    text, g = stdlib_corpus(max_bytes=2_000_000).train, torch.Generator().manual_seed(0)
    losses = []
    for _ in range(args.steps):
        x, y = batch(text, args.batch, args.seq, g, device)  # one global batch
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]  # this rank's share of it
        loss = lm_loss(model(x), y)
        loss.backward()  # FSDP2 reduce-scatters the averaged gradients
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(loss := loss.detach(), group=mesh["dp"].get_group())  # for printing
        losses.append(loss.item() / world)
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=8, help="sequences per step, in all")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks per group")
    parser.add_argument("--out", type=Path, default=None, help="write the losses here (JSON)")
    args = parser.parse_args()
    rank, world, device = setup()
    try:
        losses = train(args, rank, world, device)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        print(f"loss {losses[0]:.4f} at the first step, {losses[-1]:.4f} at step {args.steps}")
        if args.out:
            args.out.write_text(json.dumps({"world_size": world, "losses": losses}))


if __name__ == "__main__":
    main()
