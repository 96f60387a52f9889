"""Run under torchrun: the GPT trained for N steps under each strategy, its loss at every step.

    torchrun --standalone --nproc_per_node=4 -m tutorial_utils.workers.numerics \\
        --layouts hsdp fsdp2-tp --out rows.jsonl

Every process builds the GPT of the training entry point (:class:`~tutorial_utils.
gpt_trainer.GPTTrainer`: the same seed, the same global batch at each step, cut into each
data-parallel rank's rows) and takes its optimizer steps; nothing of the strategies is written
here. Every rank first trains the GPT alone, as one process would (the reference), then under
each of ``--layouts`` in turn, then DDP with each of ``--bugs``, in the same processes (one
launch: its start-up is most of a short run's time). Rank 0 writes a row per run: the loss of
the whole global batch at each step (the ranks' means averaged) and the largest difference of
a final weight to the reference's, every shard gathered.

``--bugs`` plants one mistake in DDP's step, a demonstration of what a wrong line does to the
numbers (:func:`planted_bug_step`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch.distributed.tensor import DTensor

from ..config import Config, check, opt, parse_or_exit
from ..gpt_trainer import GPTTrainer
from ..jsonl import write_jsonl
from ..parallel.distributed import DistContext, distributed
from ..parallel.strategy import clip_gradients
from ..step import gradient_sync
from ..text import Corpus, stdlib_corpus
from ..trainer import TrainConfig

Layout = Literal["one", "ddp", "fsdp2", "hsdp", "tp", "fsdp2-tp"]
Bug = Literal["none", "no-allreduce", "loss-scale", "skip-last-microbatch"]


@dataclass
class NumericsConfig(Config):
    """Run under torchrun: the GPT's loss at every step under each strategy and planted bug."""

    out: Path = opt(Path("runs/numerics.jsonl"), "rank 0 appends one row per run here")
    layouts: tuple[Layout, ...] = opt(
        ("one", "ddp"), "one process (every rank's reference, as a row); DDP; FSDP2; HSDP "
        "(replicate x shard, shard groups of half the processes); TP over every process; "
        "FSDP2 x TP (TP over pairs of processes)")
    bugs: tuple[Bug, ...] = opt(
        (), "then DDP with a planted mistake: gradients never all-reduced (every micro-batch "
        "under no_sync); the loss divided by the world size on top of DDP's average; rank 1 "
        "reducing on the micro-batch before its last")
    steps: int = opt(200, "optimizer steps")
    batch: int = opt(16, "global batch: sequences per step, shared by the data-parallel ranks")
    grad_accum: int = opt(2, "micro-batches per rank and step, reduced once, on the last")
    dim: int = opt(32, "the model width")
    heads: int = opt(4, "attention heads")
    layers: int = opt(2, "transformer blocks")
    seq: int = opt(32, "bytes per sequence")
    lr: float = opt(3e-3, "AdamW's peak learning rate (a warm-up, then a cosine)")
    clip_norm: float | None = opt(1.0, "clip the gradients to this global L2 norm")
    text_bytes: int = opt(1_000_000, "bytes of the Python standard library's source to train on")
    seed: int = opt(0, "the initial weights and the batches")

    def __post_init__(self) -> None:
        check((self.steps >= 1, f"--steps must be >= 1, got {self.steps}"),
              (not self.bugs or self.grad_accum >= 2,
               "--bugs need micro-batches: use --grad-accum 2 or more"))
        self.train_config("one", 1, Path("."))  # the entry point's own rules, before a launch

    def train_config(self, layout: Layout, world: int, out: Path) -> TrainConfig:
        """The entry point's configuration of ``layout`` on ``world`` processes (``out``: its
        checkpoints, never written here)."""
        strategy = {"fsdp2": "fsdp2", "hsdp": "hsdp", "tp": "fsdp2", "fsdp2-tp": "fsdp2"}
        return TrainConfig(
            model="gpt", strategy=strategy.get(layout, "ddp"),
            tp={"tp": world, "fsdp2-tp": 2}.get(layout, 1),
            shard_size=world // 2 if layout == "hsdp" else None,
            dim=self.dim, heads=self.heads, layers=self.layers, seq=self.seq,
            batch=self.batch, grad_accum=self.grad_accum, epochs=1, epoch_steps=self.steps,
            warmup_epochs=0.1, schedule="cosine", gpt_lr=self.lr, weight_decay=0.1,
            clip_norm=self.clip_norm, precision="fp32", device="cpu", seed=self.seed,
            data="auto", out=out)


def _fits(cfg: NumericsConfig) -> None:
    """Every layout's mesh and batch on the processes of this launch (else ConfigError)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    needs = {"hsdp": world % 2 == 0, "fsdp2-tp": world >= 4 and world % 2 == 0,
             "tp": world >= 2, "ddp": world >= 2 or not cfg.bugs}
    for layout in (*cfg.layouts, *(("ddp",) if cfg.bugs else ())):
        check((needs.get(layout, True),
               f"--layouts {layout} does not fit {world} process(es): hsdp needs an even "
               "number, tp 2 or more, fsdp2-tp an even number of 4 or more, --bugs 2 or more"))
        train = cfg.train_config(layout, world, Path("."))
        train.batches(train.data_parallel(world))


@dataclass
class NumericsRow:
    """One run: its name, the loss of the global batch at each step, its final weights."""

    run: str  # "one process", "DDP", "HSDP 2x2", "FSDP2 x TP 2x2", "bug: loss-scale", ...
    layout: str
    bug: str
    world_size: int
    losses: list[float]
    weight_diff: float | None  # largest |final weight - one process's|; None for the reference
    weight_max: float  # largest |final weight|, the scale of weight_diff
    seconds: float  # the steps' wall-clock time


def planted_bug_step(trainer: GPTTrainer, x: torch.Tensor, y: torch.Tensor,
                     bug: Bug) -> torch.Tensor:
    """DEMONSTRATION ONLY: ``GPTTrainer.forward_backward`` with one wrong line (marked BUG).

    The right step reduces once, on the last micro-batch of every rank. A rank that skips the
    reduction altogether hangs the others (DDP waits for every rank); the silent mistake is one
    that still meets them in an all-reduce, on the wrong micro-batch. AdamW divides each
    gradient by its own running scale, so a loss scaled by a constant shows only where the
    clipping (``--clip-norm``) acts on one norm and not on the other.
    """
    k, ctx = trainer.cfg.grad_accum, trainer.ctx
    trainer.optimizer.zero_grad(set_to_none=True)
    losses = []
    for i, (xi, yi) in enumerate(zip(x.chunk(k), y.chunk(k), strict=True)):
        sync = i == k - 1
        if bug == "no-allreduce":
            sync = False  # BUG: every micro-batch under no_sync; each rank keeps its gradients
        if bug == "skip-last-microbatch" and ctx.rank == 1:
            sync = i == k - 2  # BUG: off by one; the last micro-batch is added after the reduce
        scale = k
        if bug == "loss-scale":
            scale = k * ctx.world_size  # BUG: DDP already averages over the ranks
        with gradient_sync(trainer.model, enabled=sync):
            loss = trainer._forward_loss(xi, yi)[1]
            (loss / scale).backward()
        losses.append(loss.detach())
    return torch.stack(losses).mean()


def train_step(trainer: GPTTrainer, x: torch.Tensor, y: torch.Tensor, bug: Bug) -> torch.Tensor:
    """The entry point's step (``bug`` none), or the same with the planted bug."""
    if bug == "none":
        return trainer.train_step(x, y)
    loss = planted_bug_step(trainer, x, y, bug)
    if trainer.cfg.clip_norm is not None:
        clip_gradients(list(trainer.net.parameters()), trainer.cfg.clip_norm)
    trainer.optimizer.step()
    trainer.scheduler.step()
    return loss


def whole_weights(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, whole: a sharded one gathered (a collective: every rank calls it)."""
    return {k: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for k, p in net.named_parameters()}


def run_name(layout: Layout, bug: Bug, world: int) -> str:
    """How the tables and figures name a run."""
    if bug != "none":
        return f"bug: {bug}"
    return {"one": "one process", "ddp": "DDP", "fsdp2": "FSDP2", "tp": f"TP {world}",
            "hsdp": f"HSDP 2x{world // 2}", "fsdp2-tp": f"FSDP2 x TP {world // 2}x2"}[layout]


def train(cfg: NumericsConfig, layout: Layout, bug: Bug, ctx: DistContext, text: Corpus,
          reference: dict[str, torch.Tensor] | None) -> tuple[NumericsRow, dict]:
    """``cfg.steps`` steps of ``layout`` (with ``bug``): the row and the final weights."""
    trainer = GPTTrainer(cfg.train_config(layout, ctx.world_size, cfg.out.parent), ctx, text)
    losses = torch.zeros(cfg.steps)
    t0 = time.perf_counter()
    for i in range(cfg.steps):
        losses[i] = train_step(trainer, *trainer.batch(i), bug)
    seconds = time.perf_counter() - t0
    if ctx.is_distributed:  # each rank's mean over its rows; equal rows, so the mean of means
        torch.distributed.all_reduce(losses)
        losses /= ctx.world_size
    weights = whole_weights(trainer.net)  # under DDP (and its bugs) rank 0's replica
    diff = None if reference is None else max(
        float((weights[k] - w).abs().max()) for k, w in reference.items())
    top = max(float(w.abs().max()) for w in weights.values())
    return NumericsRow(run_name(layout, bug, ctx.world_size), layout, bug, ctx.world_size,
                       losses.tolist(), diff, top, seconds), weights


def run_all(cfg: NumericsConfig, ctx: DistContext, text: Corpus) -> list[NumericsRow]:
    """The reference on every rank alone, then each layout and each bug: their rows."""
    alone = DistContext(rank=0, local_rank=0, world_size=1, device=ctx.device)
    one, reference = train(cfg, "one", "none", alone, text, None)
    rows = [one] if "one" in cfg.layouts else []
    runs = [(lay, "none") for lay in cfg.layouts if lay != "one"]
    for layout, bug in runs + [("ddp", b) for b in cfg.bugs]:
        rows.append(train(cfg, layout, bug, ctx, text, reference)[0])
    return rows


def main(argv: list[str] | None = None) -> None:
    cfg = parse_or_exit(NumericsConfig, argv, __spec__.name, machine=_fits)
    text = stdlib_corpus(cfg.text_bytes)
    torch.set_num_threads(1)  # each sum in one fixed order: a run repeats bit for bit
    with distributed("cpu") as ctx:
        rows = run_all(cfg, ctx, text)
        if ctx.is_main:
            write_jsonl(cfg.out, [r.__dict__ for r in rows])


if __name__ == "__main__":
    main()
