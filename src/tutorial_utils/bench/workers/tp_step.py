"""Run under torchrun: the GPT's training step split four ways, on the same global batch.

    torchrun --standalone --nproc_per_node=2 -m tutorial_utils.bench.workers.tp_step \\
        --batch 32 --out tp.jsonl

``fsdp``: FSDP2 over all N ranks, each on batch / N sequences. ``tp``: tensor parallelism over
all N, every rank on the whole batch. ``tp+sp``: the same with sequence parallelism and the
loss on the split logits. ``2-D`` (N >= 4, even): FSDP2 over 2 groups, TP inside each. Every
mode runs bf16 autocast over fp32 weights and AdamW, as the one-GPU rows do. Rank 0 writes one
JSON line per mode: the median step time (CUDA events after warm-up) and the peak memory.
"""

from __future__ import annotations

import contextlib
import copy
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import loss_parallel

from ...config import Config, check, opt, parse_or_exit
from ...jsonl import write_jsonl
from ...models.gpt import GPT, GPTConfig, lm_loss, shape_rules
from ...parallel.distributed import DistContext, distributed
from ...parallel.tensor import tensor_parallel, two_dimensional
from ...timing import benchmark

Mode = Literal["fsdp", "tp", "tp+sp", "2-D"]


@dataclass
class TPStepConfig(Config):
    """Run under torchrun: FSDP2, TP, TP + sequence parallel and 2-D on the GPT, timed."""

    out: Path = opt(Path("runs/tp_step.jsonl"), "rank 0 writes one JSON line per mode here")
    modes: tuple[Mode, ...] = opt(("fsdp", "tp", "tp+sp", "2-D"), "2-D runs on 4 or more")
    dim: int = opt(768, "model width")
    layers: int = opt(12, "transformer blocks")
    heads: int = opt(12, "attention heads (a multiple of the TP ranks)")
    seq: int = opt(1024, "bytes per sequence (a multiple of the TP ranks)")
    batch: int = opt(32, "sequences per step, all ranks together")
    repeats: int = opt(10, "timed steps per mode")
    device: Literal["auto", "cpu", "cuda"] = opt("auto", "cuda needs one GPU per process")

    def __post_init__(self) -> None:
        check(*shape_rules(self.dim, self.heads, self.layers, self.seq),
              (self.repeats >= 1, f"--repeats must be >= 1, got {self.repeats}"))


def _enough(cfg: TPStepConfig) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    check((world >= 2, "run it under torchrun with 2 or more processes"),
          (cfg.batch % world == 0, f"--batch {cfg.batch} must split over {world} processes"),
          (cfg.heads % world == 0 and cfg.seq % world == 0,
           f"--heads {cfg.heads} and --seq {cfg.seq} must be multiples of {world} processes"))


def split(mode: Mode, model: GPT, ctx: DistContext) -> tuple[GPT, int]:
    """The model split for ``mode``, and how many data-parallel groups share the batch."""
    kind, n = ctx.device.type, ctx.world_size
    if mode == "fsdp":
        mesh = init_device_mesh(kind, (n,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh), n
    if mode == "2-D":
        return two_dimensional(model, init_device_mesh(kind, (2, n // 2),
                                                       mesh_dim_names=("dp", "tp"))), 2
    sp = mode == "tp+sp"
    return tensor_parallel(model, init_device_mesh(kind, (n,)), sequence_parallel=sp,
                           loss_parallel=sp), 1


def time_mode(mode: Mode, base: GPT, cfg: TPStepConfig, ctx: DistContext) -> dict:
    model, groups = split(mode, copy.deepcopy(base), ctx)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rows = cfg.batch // groups  # each data-parallel group's share of the global batch
    x = torch.randint(0, 256, (rows, cfg.seq), device=ctx.device)
    cuda = ctx.device.type == "cuda"

    def step():
        split_loss = loss_parallel() if mode == "tp+sp" else contextlib.nullcontext()
        with torch.autocast(ctx.device.type, torch.bfloat16, enabled=cuda), split_loss:
            lm_loss(model(x), x).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(ctx.device)
    t = benchmark(step, warmup=3, repeats=cfg.repeats, device=ctx.device)
    mesh = {"fsdp": f"dp {ctx.world_size}", "2-D": f"dp 2 x tp {ctx.world_size // 2}"}
    return {"mode": mode, "world_size": ctx.world_size, "mesh": mesh.get(mode,
            f"tp {ctx.world_size}"), "batch": cfg.batch, "step_ms": t.median_ms,
            "tokens_per_s": cfg.batch * cfg.seq / (t.median_ms / 1e3),
            "peak_gib": torch.cuda.max_memory_allocated(ctx.device) / 2**30 if cuda else None}


def main(argv: list[str] | None = None) -> None:
    cfg = parse_or_exit(TPStepConfig, argv, __spec__.name, machine=_enough)
    with distributed(cfg.device) as ctx:
        torch.manual_seed(0)
        base = GPT(GPTConfig(seq=cfg.seq, layers=cfg.layers, heads=cfg.heads, dim=cfg.dim))
        base = base.to(ctx.device)
        modes = [m for m in cfg.modes if m != "2-D" or (ctx.world_size >= 4
                                                        and ctx.world_size % 2 == 0)]
        rows = [time_mode(m, base, cfg, ctx) for m in modes]
        if ctx.is_main:
            write_jsonl(cfg.out, rows)


if __name__ == "__main__":
    main()
