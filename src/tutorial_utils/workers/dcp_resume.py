"""Run under torchrun, on any number of processes: train with sharded checkpoints, and resume.

    torchrun --standalone --nproc_per_node=2 -m tutorial_utils.workers.dcp_resume \\
        --steps 6 --save-every 2 --ckpt runs/dcp --out runs/dcp-final.pt
    torchrun --standalone --nproc_per_node=1 -m tutorial_utils.workers.dcp_resume \\
        --steps 8 --resume --ckpt runs/dcp --out runs/dcp-final-1.pt

A step trains on ``--slices`` slices of ``--batch`` images each, the same ones whatever the job
shape: two processes take one slice each (FSDP2, gradients averaged by the reduce-scatter);
one process takes both in turn and averages their gradients itself, the same arithmetic.
Every ``--save-every`` steps the sharded model and optimizer are saved with DCP, atomically
(:func:`~tutorial_utils.sharded_checkpoint.save_sharded`); with ``--resume`` the job starts from
the newest complete checkpoint, whatever number of processes wrote it. At the end, rank 0
writes the full weights and momentum to ``--out`` (one ``torch.save`` file), and with
``--naive-save PATH`` also what a plain ``torch.save(model.state_dict())`` on rank 0 holds.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from ..checkpoint import CheckpointError
from ..config import Config, ConfigError, check, check_wrn, opt, parse_or_exit
from ..devices import NotEnoughGPUsError
from ..jsonl import write_jsonl
from ..models.wrn import wide_resnet
from ..parallel.distributed import DistContext, all_reduce_sum, distributed
from ..parallel.fsdp import shard
from ..sharded_checkpoint import commit, latest_checkpoint, load_sharded, write_uncommitted

KILL_ENV = "TUTORIAL_KILL_IN_SAVE"  # fault injection for the tests and the book, not a setting


@dataclass
class DcpConfig(Config):
    """Run under torchrun, on any number of processes: train with sharded checkpoints, resume."""

    ckpt: Path = opt(doc="folder of the step-N checkpoints")
    out: Path = opt(doc="the final full state, written by rank 0")
    model: str = opt("wrn-10-1", "the network, WRN-depth-width")
    batch: int = opt(4, "images per slice")
    slices: int = opt(2, "slices per step (the data width)")
    steps: int = opt(6, "train until this step")
    save_every: int = opt(2, "steps between checkpoints (0: never)")
    resume: bool = opt(False, "start from the newest complete checkpoint")
    accept_undigested: bool = opt(False, "with --resume, also accept a step folder without "
                                  "digests.json (written before digests existed), unverified")
    naive_save: Path | None = opt(None, "also torch.save(model.state_dict()) here")
    metrics: Path | None = opt(None, "rank 0 appends JSON lines here")
    device: Literal["auto", "cpu", "cuda"] = opt("cpu", "cuda needs one GPU per process")

    def __post_init__(self) -> None:
        check_wrn(self.model)
        check((min(self.batch, self.slices, self.steps) >= 1,
               "--batch, --slices and --steps must be >= 1"),
              (self.save_every >= 0, f"--save-every must be >= 0, got {self.save_every}"),
              (not self.ckpt.exists() or self.ckpt.is_dir(),
               f"--ckpt {self.ckpt} is a file; name the folder of the step-N checkpoints"),
              (not self.out.is_dir(), f"--out {self.out} is a folder; name the file to write"))


def batch(step: int, index: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slice ``index`` of step ``step``: the same images in every job shape."""
    g = torch.Generator().manual_seed(1000 * step + index)
    return torch.randn(size, 3, 32, 32, generator=g), torch.randint(0, 10, (size,), generator=g)


def train_step(step: int, model, opt, ctx: DistContext, args: DcpConfig) -> float:
    """One step over all slices of ``step``; returns their mean loss."""
    mine = range(ctx.rank, args.slices, ctx.world_size)  # this process's slices
    opt.zero_grad(set_to_none=True)
    total = 0.0
    for i in mine:
        x, y = (t.to(ctx.device) for t in batch(step, i, args.batch))
        # Halving a loss halves its gradients exactly (a power of two), so accumulating two
        # halves here adds the same numbers as the reduce-scatter does on two processes.
        loss = F.cross_entropy(model(x), y) / len(mine)
        loss.backward()
        total += loss.item()
    opt.step()
    return all_reduce_sum(ctx, total)[0] / ctx.world_size


def save(step: int, model, opt, ctx: DistContext, args: DcpConfig) -> None:
    tmp = write_uncommitted(args.ckpt, step, model, opt, ctx)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if os.environ.get(KILL_ENV) == str(step) and first_attempt and ctx.rank == ctx.world_size - 1:
        print(f"rank {ctx.rank}: killed while saving step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # the shards are written; the commit never comes
    commit(args.ckpt, tmp, ctx)


def export(model, opt, ctx: DistContext, args: DcpConfig) -> None:
    """Rank 0 writes the whole model and optimizer state, gathered from every rank."""
    # Collective: every rank takes part; with cpu_offload only rank 0 keeps the result.
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(model, opt, options=full)
    if ctx.is_main:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"model": model_sd, "optim": optim_sd}, args.out)
        if args.naive_save:  # the mistake: each value is a DTensor holding rank 0's shard
            torch.save(model.state_dict(), args.naive_save)


def main(argv: list[str] | None = None) -> None:
    args = parse_or_exit(DcpConfig, argv, __spec__.name)
    try:
        run(args)
    # every rank fails alike: one line each
    except (ConfigError, CheckpointError, NotEnoughGPUsError) as err:
        print(f"python -m {__spec__.name}: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def resume(model, opt, ctx: DistContext, args: DcpConfig) -> tuple[int, Path | None]:
    """The step of the newest complete checkpoint, loaded into ``model`` and ``opt``, and its
    folder; (0, None) if there is none yet."""
    found = latest_checkpoint(args.ckpt, args.accept_undigested, quiet=not ctx.is_main)
    if found is None:
        if ctx.is_main:  # a first attempt, or a mistyped --ckpt: say which it is
            print(f"--resume: no complete checkpoint in {args.ckpt} yet; training from step 1",
                  file=sys.stderr, flush=True)
        return 0, None
    return load_sharded(found, model, opt, require_digests=not args.accept_undigested), found


def run(args: DcpConfig) -> None:
    with distributed(args.device) as ctx:
        check((args.slices % ctx.world_size == 0,
               f"--slices {args.slices} must be a multiple of the {ctx.world_size} processes"))
        if ctx.device.type == "cpu":
            # torchrun gives each of several processes one thread, a lone process all cores;
            # one thread everywhere makes the CPU kernels add up in the same order.
            torch.set_num_threads(1)
        torch.manual_seed(0)
        model = shard(wide_resnet(args.model).to(ctx.device), ctx)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        start, found = resume(model, opt, ctx, args) if args.resume else (0, None)
        losses = []
        for step in range(start + 1, args.steps + 1):
            losses.append(train_step(step, model, opt, ctx, args))
            if args.save_every and step % args.save_every == 0:
                save(step, model, opt, ctx, args)
        export(model, opt, ctx, args)
        if ctx.is_main:
            record = {"world_size": ctx.world_size, "resumed_from": found and found.name,
                      "start_step": start, "steps": args.steps, "losses": losses}
            print(json.dumps(record), flush=True)
            if args.metrics:
                write_jsonl(args.metrics, [record])


if __name__ == "__main__":
    main()
