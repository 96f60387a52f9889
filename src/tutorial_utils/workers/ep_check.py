"""Run under torchrun: does the expert-parallel GPT compute what one process computes?

    torchrun --standalone --nproc_per_node=2 -m tutorial_utils.workers.ep_check --out r.jsonl

Every rank builds the same mixture-of-experts GPT and the same batch. One process's loss and
gradients on the whole batch are the reference. Then each rank keeps E / N experts
(:func:`~tutorial_utils.parallel.experts.split_experts`) and its own share of the batch, and
its loss is divided by N, so that the ranks' losses add up to the batch's mean. The gradients
of what every rank holds (the router, attention, embeddings) are summed over the ranks, as
data parallelism would; each expert's is compared whole on the rank that holds it. Rank 0
writes one row per (experts, top_k): the largest differences (the loss, the logits and the
gradients), the tokens each expert got and the bytes each rank sent by all-to-all.
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

from ..config import Config, check, opt, parse_or_exit
from ..jsonl import write_jsonl
from ..models.gpt import GPT, GPTConfig, lm_loss, shape_rules
from ..parallel.distributed import DistContext, distributed
from ..parallel.experts import expert_of, expert_rules, imbalance, predicted_bytes, split_experts


@dataclass
class EPCheckConfig(Config):
    """Run under torchrun: does expert parallelism give one process's loss and gradients?"""

    out: Path = opt(Path("runs/ep_check.jsonl"), "rank 0 writes one JSON line per run here")
    experts: tuple[int, ...] = opt((4,), "experts per block, a run each (multiples of the ranks)")
    top_k: tuple[int, ...] = opt((2,), "experts per token, a run each with every --experts")
    dim: int = opt(32, "the model width")
    heads: int = opt(2, "attention heads")
    layers: int = opt(2, "transformer blocks")
    seq: int = opt(16, "tokens per sequence")
    batch: int = opt(4, "sequences in the whole batch (a multiple of the processes)")
    device: Literal["auto", "cpu", "cuda"] = opt("auto", "cuda needs one GPU per process")

    def __post_init__(self) -> None:
        check(*shape_rules(self.dim, self.heads, self.layers, self.seq),
              (bool(self.experts) and bool(self.top_k), "--experts and --top-k need values"))


@dataclass
class EPRow:
    """One (experts, top_k) run: how far from one process, and what the dispatch moved."""

    world: int
    experts: int
    top_k: int
    tokens: int  # routed per block, all ranks together
    loss_diff: float
    out_diff: float  # the logits of every rank's tokens
    router_grad_diff: float
    expert_grad_diff: float
    other_grad_diff: float  # attention, norms, embeddings, output layer
    per_expert: tuple[int, ...]  # the first block's assignments to each expert, all ranks
    imbalance: float  # the first block's: busiest expert over the mean
    bytes_out: tuple[int, ...]  # each rank's bytes to the other ranks, forward, all blocks
    predicted_bytes: float  # the same for a router that spreads tokens evenly


def _enough(cfg: EPCheckConfig) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tokens = cfg.batch // max(world, 1) * cfg.seq
    check((world >= 2, "run it under torchrun with 2 or more processes"),
          (cfg.batch % world == 0, f"--batch {cfg.batch} must split over {world} processes"),
          *(rule for e in cfg.experts for k in cfg.top_k
            for rule in expert_rules(e, k, world, tokens)))


def grad_diffs(model: GPT, reference: GPT, ctx: DistContext, local: int) -> dict[str, float]:
    """The largest difference from the reference's gradients, by kind, over all ranks."""
    whole = dict(reference.named_parameters())
    worst = torch.zeros(3, device=ctx.device)  # router, expert, other
    for name, p in model.named_parameters():
        g = p.grad
        if ".experts." not in name:  # held by every rank: its gradient sums theirs
            g = g.clone()
            dist.all_reduce(g)
        kind = 0 if ".router." in name else 1 if ".experts." in name else 2
        diff = (g - whole[expert_of(name, ctx.rank, local)].grad).abs().max()
        worst[kind] = max(worst[kind], float(diff))
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return dict(zip(("router_grad_diff", "expert_grad_diff", "other_grad_diff"),
                    worst.tolist(), strict=True))


def check_one(cfg: EPCheckConfig, experts: int, top_k: int, ctx: DistContext) -> EPRow:
    torch.manual_seed(0)  # the same model and batch on every rank
    base = GPT(GPTConfig(vocab=256, seq=cfg.seq, layers=cfg.layers, heads=cfg.heads,
                         dim=cfg.dim, experts=experts, top_k=top_k)).to(ctx.device)
    x, y = torch.randint(0, 256, (2, cfg.batch, cfg.seq), device=ctx.device)
    reference = copy.deepcopy(base)
    whole = reference(x)
    whole_loss = lm_loss(whole, y)
    whole_loss.backward()
    model = split_experts(copy.deepcopy(base))
    share = cfg.batch // ctx.world_size
    rows = slice(ctx.rank * share, (ctx.rank + 1) * share)
    logits = model(x[rows])
    loss = lm_loss(logits, y[rows]) / ctx.world_size
    loss.backward()
    loss = loss.detach().clone()
    dist.all_reduce(loss)
    out_diff = (logits - whole[rows]).detach().abs().max()
    dist.all_reduce(out_diff, op=dist.ReduceOp.MAX)
    diffs = grad_diffs(model, reference, ctx, experts // ctx.world_size)
    first = torch.tensor(model.blocks[0].mlp.last.per_expert, device=ctx.device)
    dist.all_reduce(first)
    mine = torch.tensor(sum(b.mlp.last.bytes_out(ctx.rank) for b in model.blocks),
                        device=ctx.device)
    sent = [torch.zeros_like(mine) for _ in range(ctx.world_size)]
    dist.all_gather(sent, mine)
    return EPRow(ctx.world_size, experts, top_k, cfg.batch * cfg.seq,
                 float((loss - whole_loss.detach()).abs()), float(out_diff), **diffs,
                 per_expert=tuple(first.tolist()),
                 imbalance=imbalance(first.tolist()), bytes_out=tuple(int(s) for s in sent),
                 predicted_bytes=cfg.layers * predicted_bytes(share * cfg.seq, cfg.dim, top_k,
                                                              ctx.world_size))


def main(argv: list[str] | None = None) -> None:
    cfg = parse_or_exit(EPCheckConfig, argv, __spec__.name, machine=_enough)
    with distributed(cfg.device) as ctx:
        rows = [check_one(cfg, e, k, ctx) for e in cfg.experts for k in cfg.top_k]
        if ctx.is_main:
            write_jsonl(cfg.out, [dataclasses.asdict(r) for r in rows])


if __name__ == "__main__":
    main()
