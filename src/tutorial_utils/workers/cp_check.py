"""Run under torchrun: does context parallelism compute the attention one process computes?

    torchrun --standalone --nproc_per_node=2 -m tutorial_utils.workers.cp_check --out r.jsonl

Every rank draws the same q, k, v and output gradient for the whole sequence; causal SDPA on
all of it, forward and backward in one process, is the reference. Each mode then gives every
rank its share of the sequence (:func:`~tutorial_utils.parallel.context.shard`), runs forward
and backward, gathers the output and the gradients of q, k and v back into one sequence and
compares them with the reference. ``gpt`` does the same for the whole GPT with ring attention
in every block: its loss and every parameter's gradient, summed over the ranks. Rank 0 writes
one row per (mode, sequence length), with what the attention kept for backward on the busiest
rank, measured by a saved-tensors hook, beside the prediction.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..config import Config, check, opt, parse_or_exit
from ..devices import gpu_count
from ..jsonl import write_jsonl
from ..memory import saved_tensors
from ..models.gpt import GPT, GPTConfig, lm_loss
from ..parallel.context import (
    attention_bytes_per_rank,
    causal_blocks,
    check_split,
    gathered_attention,
    positions,
    pytorch_ring,
    ring_attention,
    shard,
    split_sequence,
    unshard,
)
from ..parallel.distributed import DistContext, distributed

Mode = Literal["ring", "ring-zigzag", "gathered", "gpt", "context_parallel"]
ZIGZAG = {"ring": False, "ring-zigzag": True, "gathered": False, "gpt": True,
          "context_parallel": True}


@dataclass
class CPCheckConfig(Config):
    """Run under torchrun: does context parallelism give one process's attention?"""

    out: Path = opt(Path("runs/cp_check.jsonl"), "rank 0 writes one JSON line per check here")
    modes: tuple[Mode, ...] = opt(("ring", "ring-zigzag", "gathered", "gpt"),
                                  "what to check (context_parallel needs a GPU per process)")
    seqs: tuple[int, ...] = opt((32,), "sequence lengths, a row each (multiples of 2N)")
    batch: int = opt(2, "sequences")
    heads: int = opt(2, "attention heads")
    head_dim: int = opt(8, "values per head")
    device: Literal["auto", "cpu", "cuda"] = opt("auto", "cuda needs one GPU per process")

    def __post_init__(self) -> None:
        check((bool(self.seqs) and bool(self.modes), "--seqs and --modes need values"),
              (min(self.batch, self.heads, self.head_dim, *self.seqs) >= 1,
               "--batch, --heads, --head-dim and --seqs must be >= 1"))


@dataclass
class CPRow:
    """One mode at one sequence length: how far from one process, and what it kept."""

    mode: str
    world: int
    seq: int
    zigzag: bool
    out_diff: float  # the output (gpt: the loss)
    grad_diff: float  # q, k and v (gpt: every parameter)
    blocks: tuple[int, ...]  # chunk pairs each rank computed (ring modes; gathered: none)
    saved_bytes: int | None = None  # kept for backward by the attention, busiest rank
    predicted_bytes: int | None = None  # attention_bytes_per_rank (the ring's)
    one_process_bytes: int | None = None  # the reference's, the whole sequence in one process


def _enough(cfg: CPCheckConfig) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    check((world >= 2, "run it under torchrun with 2 or more processes"),
          ("context_parallel" not in cfg.modes or (cfg.device != "cpu" and gpu_count() >= 1),
           "--modes context_parallel needs a GPU per process: PyTorch's context_parallel "
           "runs SDPA's CUDA kernels"))
    for seq in cfg.seqs:
        for mode in cfg.modes:
            check_split(seq, world, ZIGZAG[mode])


def gather(x: torch.Tensor, ctx: DistContext, zigzag: bool, dim: int = 2) -> torch.Tensor:
    """Every rank's shard of ``x``, back in sequence order."""
    parts = [torch.empty_like(x) for _ in range(ctx.world_size)]
    dist.all_gather(parts, x.contiguous())
    return unshard(parts, zigzag, dim)


def _busiest(n: int, ctx: DistContext) -> int:
    t = torch.tensor(n, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t)


def _run(mode: Mode, whole, dout, ctx: DistContext):
    """This rank's output shard, its q, k, v gradients and the bytes kept for backward."""
    zigzag = ZIGZAG[mode]
    mine = [shard(t.detach(), ctx.rank, ctx.world_size, zigzag).requires_grad_() for t in whole]
    dout = shard(dout, ctx.rank, ctx.world_size, zigzag)
    if mode == "context_parallel":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cuda", (ctx.world_size,))
        with pytorch_ring(mesh, dout.shape[2] * ctx.world_size, ctx.device):
            out = F.scaled_dot_product_attention(*mine, is_causal=True)
            out.backward(dout)
        return out, [t.grad for t in mine], None
    attend = gathered_attention if mode == "gathered" else ring_attention
    with saved_tensors() as kept:
        out = attend(*mine, zigzag=zigzag)
    out.backward(dout)
    return out, [t.grad for t in mine], sum(kept["activations"].values())


def check_attention(mode: Mode, seq: int, cfg: CPCheckConfig, ctx: DistContext) -> CPRow:
    torch.manual_seed(seq)  # the same tensors on every rank
    q, k, v, dout = torch.randn(4, cfg.batch, cfg.heads, seq, cfg.head_dim,
                                device=ctx.device).unbind(0)
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    with saved_tensors() as one:
        reference = F.scaled_dot_product_attention(*whole, is_causal=True)
    reference.backward(dout)
    zigzag = ZIGZAG[mode]
    out, grads, kept = _run(mode, whole, dout, ctx)
    grad_diff = max(float((gather(g, ctx, zigzag) - t.grad).abs().max())
                    for g, t in zip(grads, whole, strict=True))
    return CPRow(mode, ctx.world_size, seq, zigzag,
                 float((gather(out.detach(), ctx, zigzag) - reference.detach()).abs().max()),
                 grad_diff,
                 () if mode == "gathered" else tuple(causal_blocks(r, ctx.world_size, zigzag)
                                                     for r in range(ctx.world_size)),
                 None if kept is None else _busiest(kept, ctx),
                 None if mode == "gathered" else attention_bytes_per_rank(
                     cfg.batch, cfg.heads, seq, cfg.head_dim, ctx.world_size),
                 sum(one["activations"].values()))


def check_gpt(seq: int, cfg: CPCheckConfig, ctx: DistContext) -> CPRow:
    torch.manual_seed(0)  # the same model and batch on every rank
    base = GPT(GPTConfig(vocab=256, seq=seq, layers=2, heads=cfg.heads,
                         dim=cfg.heads * cfg.head_dim)).to(ctx.device)
    x, y = torch.randint(0, 256, (2, cfg.batch, seq), device=ctx.device)
    reference = copy.deepcopy(base)
    whole_loss = lm_loss(reference(x), y)
    whole_loss.backward()
    model = split_sequence(copy.deepcopy(base), zigzag=True)
    rank, world = ctx.rank, ctx.world_size
    mine = [shard(t, rank, world, True, dim=1) for t in (x, y)]
    # every rank has as many tokens: their mean losses over N add up to the batch's mean
    loss = lm_loss(model(mine[0], positions(seq, rank, world, True, ctx.device)), mine[1])
    (loss / world).backward()
    loss = loss.detach() / world
    dist.all_reduce(loss)
    worst = 0.0
    for p, r in zip(model.parameters(), reference.parameters(), strict=True):
        g = p.grad.clone()
        dist.all_reduce(g)
        worst = max(worst, float((g - r.grad).abs().max()))
    return CPRow("gpt", world, seq, True, float((loss - whole_loss.detach()).abs()), worst,
                 tuple(causal_blocks(r, world, True) for r in range(world)))


def main(argv: list[str] | None = None) -> None:
    cfg = parse_or_exit(CPCheckConfig, argv, __spec__.name, machine=_enough)
    with distributed(cfg.device) as ctx:
        rows = [check_gpt(seq, cfg, ctx) if mode == "gpt" else
                check_attention(mode, seq, cfg, ctx) for seq in cfg.seqs for mode in cfg.modes]
        if ctx.is_main:
            write_jsonl(cfg.out, [dataclasses.asdict(r) for r in rows])


if __name__ == "__main__":
    main()
