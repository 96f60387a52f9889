"""Run under torchrun: the GPT on a 3-D or 4-D mesh, trained a few steps, against one process.

    torchrun --standalone --nproc_per_node=8 -m tutorial_utils.workers.hybrid_check \\
        --dp 1 --cp 2 --pp 2 --tp 2 --out h.jsonl

Every process builds only its part of the model (:mod:`tutorial_utils.parallel.hybrid`): its
pipeline stage, of that its tensor-parallel slices, of those its FSDP shard, with ring
attention over the cp ranks. All train ``--steps`` steps of AdamW on the same global batches,
each dp group on its sequences and each cp rank on its zig-zag slice of them; one process
also trains the whole GPT on the whole batches. Rank 0 writes one :class:`HybridRow`: the
largest difference of the loss over the steps and of the first step's gradients, what each
process holds (parameters, gradients, optimizer state, for the planner's memory model), and
with ``--repeats`` the step time.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..config import Config, check, opt, parse_or_exit
from ..jsonl import write_jsonl
from ..memory import storage_bytes
from ..models.gpt import GPTConfig, lm_loss, shape_rules
from ..parallel.distributed import DistContext, distributed
from ..parallel.gpt_pipeline import stage_parameter_names
from ..parallel.hybrid import DIMS, Hybrid, MeshShape, build_hybrid, check_mesh
from ..timing import benchmark
from .gpt_pipeline import adamw, reference_run


@dataclass
class HybridRow:
    """The composed run against one process, and what each process held."""

    mesh: dict[str, int]
    schedule: str
    micro_batches: int
    batch: int
    steps: int
    losses: list[float]
    reference_losses: list[float]
    loss_diff: float
    grad_diff: float
    max_grad: float
    params_per_rank: list[int]  # parameter values each process holds (its shards)
    param_bytes: list[int]
    grad_bytes: list[int]
    optimizer_bytes: list[int]  # AdamW's two moments (its step counters left out)
    step_ms: float | None = None


@dataclass
class HybridConfig(Config):
    """Run under torchrun: a GPT on a dp x pp x cp x tp mesh, trained a few steps, against one
    process."""

    dp: int = opt(2, "data-parallel groups (FSDP2 inside each)")
    cp: int = opt(1, "context-parallel ranks (ring attention; each takes 1/cp of every "
                     "sequence)")
    pp: int = opt(2, "pipeline stages")
    tp: int = opt(2, "tensor-parallel ranks")
    schedule: Literal["gpipe", "1f1b", "interleaved-1f1b", "zbv"] = opt("1f1b", "pipeline "
                                                                          "schedule")
    micro_batches: int = opt(2, "micro-batches per dp group and step")
    batch: int = opt(8, "sequences per step, all dp groups together")
    dim: int = opt(32, "model width")
    heads: int = opt(2, "attention heads")
    layers: int = opt(2, "transformer blocks")
    seq: int = opt(16, "tokens per sequence")
    steps: int = opt(3, "training steps compared with one process")
    repeats: int = opt(0, "timed steps (0: no timing)")
    device: Literal["auto", "cpu", "cuda"] = opt("auto", "cuda needs one GPU per process")
    out: Path = opt(Path("runs/hybrid.jsonl"), "rank 0 writes its row here")

    def __post_init__(self) -> None:
        check(*shape_rules(self.dim, self.heads, self.layers, self.seq),
              (self.steps >= 1 and self.repeats >= 0, "--steps must be >= 1, --repeats >= 0"))

    @property
    def shape(self) -> MeshShape:
        return MeshShape(dp=self.dp, pp=self.pp, cp=self.cp, tp=self.tp)

    @property
    def model(self) -> GPTConfig:
        return GPTConfig(seq=self.seq, layers=self.layers, heads=self.heads, dim=self.dim)


def _fits(cfg: HybridConfig) -> None:
    check_mesh(cfg.shape, int(os.environ.get("WORLD_SIZE", "1")), cfg.model, cfg.batch,
               cfg.micro_batches, cfg.schedule)


def data(cfg: HybridConfig, device):
    g = torch.Generator().manual_seed(1)
    size = (cfg.batch, cfg.seq)
    return [(torch.randint(0, 256, size, generator=g).to(device),
             torch.randint(0, 256, size, generator=g).to(device)) for _ in range(cfg.steps)]


def train_step(h: Hybrid, x, y) -> float:
    """One step's forward and backward on this process's part of the batch (its dp group's
    rows, its cp rank's tokens); this process's loss (its micro-batches' mean) if it holds a
    share of the loss, else 0."""
    x, y = h.local_batch(x, y)
    if h.pipeline is not None:
        losses = h.pipeline.step(x, y)
        return torch.stack(losses).mean().item() if h.pipeline.has_last else 0.0
    h.module.zero_grad(set_to_none=True)
    loss = lm_loss(h.module(x), y)
    loss.backward()
    return loss.item()


def global_loss(ctx: DistContext, h: Hybrid, mine: float) -> float:
    """The global batch's loss: the mean over the dp x cp ranks of the last stage's losses."""
    shares = h.shape.dp * h.shape.cp
    t = torch.tensor([mine / shares if h.holds_loss else 0.0], dtype=torch.float64,
                     device=ctx.device)
    dist.all_reduce(t)
    return t.item()


def full_grads(h: Hybrid, cfg: HybridConfig) -> dict[str, torch.Tensor]:
    """This process's stages' gradients, whole (DTensors gathered), by the GPT's names."""
    out = {}
    modules = h.pipeline.modules if h.pipeline else [h.module]
    indices = h.pipeline.indices if h.pipeline else [0]
    n_stages = len(modules) * cfg.pp
    for index, module in zip(indices, modules, strict=True):
        names = stage_parameter_names(cfg.model, index, n_stages)
        for name, p in zip(names, module.parameters(), strict=True):
            g = p.grad
            out[name] = g.full_tensor() if isinstance(g, DTensor) else g
    return out


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def per_rank(ctx: DistContext, value: float) -> list[int]:
    t = torch.zeros(ctx.world_size, dtype=torch.float64, device=ctx.device)
    t[ctx.rank] = value
    dist.all_reduce(t)
    return [int(v) for v in t.tolist()]


def compare(cfg: HybridConfig, ctx: DistContext) -> HybridRow:
    batches = data(cfg, ctx.device)
    h = build_hybrid(cfg.model, cfg.shape, ctx.device, cfg.micro_batches, cfg.schedule)
    params = list(h.parameters())
    opt = adamw(params)
    ref_losses, ref_grads = reference_run(cfg, batches, ctx.device)  # one process
    losses, grad_diff, scale, grad_bytes = [], 0.0, 0.0, 0
    for i, (x, y) in enumerate(batches):
        losses.append(global_loss(ctx, h, train_step(h, x, y)))
        if i == 0:
            grad_bytes = storage_bytes(local(p.grad) for p in params if p.grad is not None)
            for name, g in full_grads(h, cfg).items():
                grad_diff = max(grad_diff, float((g - ref_grads[name]).abs().max()))
                scale = max(scale, float(ref_grads[name].abs().max()))
        opt.step()
    t = torch.tensor([grad_diff, scale], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    state = [local(v) for s in opt.state.values() for k, v in s.items() if k != "step"]
    row = HybridRow(
        {d: getattr(cfg.shape, d) for d in DIMS}, cfg.schedule, cfg.micro_batches, cfg.batch,
        cfg.steps, losses, ref_losses,
        max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)), *t.tolist(),
        per_rank(ctx, sum(local(p).numel() for p in params)),
        per_rank(ctx, storage_bytes(local(p) for p in params)), per_rank(ctx, grad_bytes),
        per_rank(ctx, storage_bytes(state)))
    if cfg.repeats:
        x, y = batches[0]
        step = benchmark(lambda: train_step(h, x, y), warmup=2, repeats=cfg.repeats,
                         device=ctx.device).median_ms
        t = torch.tensor([step], dtype=torch.float64, device=ctx.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        row.step_ms = t.item()
    return row


def main(argv: list[str] | None = None) -> None:
    cfg = parse_or_exit(HybridConfig, argv, __spec__.name, machine=_fits)
    # FSDP2 warns of a stage returning a view (the head's logits, a DTensor's local view): no
    # in-place op follows here. Gathering a gradient sharded over both dp x cp and tp takes two
    # all-gathers, of which DTensor warns (through its logger, once per rank): this is a check,
    # not the training step.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    with distributed(cfg.device) as ctx:
        row = compare(cfg, ctx)
        if ctx.is_main:
            write_jsonl(cfg.out, [dataclasses.asdict(row)])


if __name__ == "__main__":
    main()
