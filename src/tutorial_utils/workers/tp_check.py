"""Run under torchrun: do the tensor-parallel GPTs compute what one process computes?

    torchrun --standalone --nproc_per_node=2 -m tutorial_utils.workers.tp_check --out r.jsonl

Every rank builds the same GPT and the same batch. One process's loss and gradients on the
whole batch are the reference; each mode splits a copy of the model, runs the same step, and
compares the loss and every gradient, each reassembled whole (``full_tensor()`` for a DTensor,
the ranks' slices concatenated for the layers written by hand). Rank 0 writes one JSON line per
mode: the largest differences, and the parameter values one rank holds.
"""

from __future__ import annotations

import contextlib
import copy
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from ..config import Config, check, opt, parse_or_exit
from ..jsonl import write_jsonl
from ..models.gpt import GPT, GPTConfig, lm_loss, shape_rules
from ..parallel.distributed import DistContext, distributed
from ..parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    split_by_hand,
    tensor_parallel,
    two_dimensional,
)

Mode = Literal["by-hand", "parallelize_module", "sequence-parallel", "2-D"]
MODES: tuple[Mode, ...] = ("by-hand", "parallelize_module", "sequence-parallel", "2-D")


@dataclass
class TPCheckConfig(Config):
    """Run under torchrun: do the tensor-parallel GPTs give one process's loss and gradients?"""

    out: Path = opt(Path("runs/tp_check.jsonl"), "rank 0 appends one JSON line per mode here")
    modes: tuple[Mode, ...] = opt((), "what to check (default: every mode that fits the "
                                  "processes; 2-D needs 4 or more, an even number)")
    dim: int = opt(64, "the model width")
    heads: int = opt(4, "attention heads (a multiple of the processes, for TP over all of them)")
    layers: int = opt(2, "transformer blocks")
    seq: int = opt(32, "tokens per sequence (a multiple of the processes, for sequence parallel)")
    batch: int = opt(4, "sequences in the batch (even, for the 2-D mesh)")
    device: Literal["auto", "cpu", "cuda"] = opt("auto", "cuda needs one GPU per process")

    def __post_init__(self) -> None:
        check(*shape_rules(self.dim, self.heads, self.layers, self.seq),
              (self.batch % 2 == 0, f"--batch must be even, got {self.batch}"))

    def modes_for(self, world: int) -> tuple[Mode, ...]:
        return self.modes or tuple(m for m in MODES if m != "2-D" or _two_d_fits(world))


def _two_d_fits(world: int) -> bool:
    return world >= 4 and world % 2 == 0


def gathered_grads(model: torch.nn.Module, group=None) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, whole: DTensors gathered, hand-split slices concatenated."""
    out = {}
    for module_name, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            if p.grad is None:  # no gradient at all: nothing to compare, the check fails
                continue
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            dim = ({"weight": 0, "bias": 0}.get(name) if isinstance(module, ColumnParallelLinear)
                   else 1 if isinstance(module, RowParallelLinear) and name == "weight" else None)
            if dim is not None:
                parts = [torch.empty_like(g) for _ in range(dist.get_world_size(group))]
                dist.all_gather(parts, g.contiguous(), group=group)
                g = torch.cat(parts, dim)
            out[f"{module_name}.{name}".lstrip(".")] = g
    return out


def _split(mode: Mode, model: GPT, ctx: DistContext):
    """The split model and the rows of the batch this rank trains on."""
    everything = slice(None)
    if mode == "by-hand":
        return split_by_hand(model), everything
    if mode == "2-D":
        mesh = init_device_mesh(ctx.device.type, (2, ctx.world_size // 2),
                                mesh_dim_names=("dp", "tp"))
        return two_dimensional(model, mesh), mesh["dp"].get_local_rank()
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    sp = mode == "sequence-parallel"
    return tensor_parallel(model, mesh, sequence_parallel=sp, loss_parallel=sp), everything


def check_mode(mode: Mode, base: GPT, x, y, reference: dict, ctx: DistContext) -> dict:
    model, rows = _split(mode, copy.deepcopy(base), ctx)
    if not isinstance(rows, slice):  # a dp rank: its half of the batch
        half = x.shape[0] // 2
        rows = slice(rows * half, (rows + 1) * half)
    with loss_parallel() if mode == "sequence-parallel" else contextlib.nullcontext():
        loss = lm_loss(model(x[rows]), y[rows])
        loss.backward()
    loss = loss.detach()
    if isinstance(loss, DTensor):
        loss = loss.full_tensor()
    if mode == "2-D":  # each dp half had its own mean: their average is the whole batch's
        loss = loss.clone()
        dist.all_reduce(loss)
        loss = loss / ctx.world_size
    grads = gathered_grads(model)
    mine = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    params, whole = dict(model.named_parameters()), dict(base.named_parameters())
    return {"mode": mode, "world_size": ctx.world_size,
            "loss_diff": float((loss - reference["loss"]).abs()),
            "grad_diff": max(float((grads[k] - g).abs().max()) if k in grads else float("inf")
                             for k, g in reference.items() if k != "loss"),
            "params_per_rank": sum(p.numel() for p in mine),
            "params_total": sum(p.numel() for p in base.parameters()),
            "layout": {name: layout(params[name], whole[name]) for name in SHOWN}}


SHOWN = ("blocks.0.attn.q.weight", "blocks.0.attn.o.weight", "blocks.0.attn.o.bias",
         "blocks.0.norm1.weight", "head.weight")


def layout(p: torch.Tensor, whole: torch.Tensor) -> dict:
    """A parameter's whole shape, the shape this rank holds, and (a DTensor) its placements."""
    local = p.to_local() if isinstance(p, DTensor) else p
    return {"shape": list(whole.shape), "local": list(local.shape),
            "placements": [str(x) for x in p.placements] if isinstance(p, DTensor) else None}


def compare(cfg: TPCheckConfig, ctx: DistContext) -> list[dict]:
    torch.manual_seed(0)  # the same model and batch on every rank
    gpt = GPTConfig(vocab=256, seq=cfg.seq, layers=cfg.layers, heads=cfg.heads, dim=cfg.dim)
    base = GPT(gpt).to(ctx.device)
    x = torch.randint(0, 256, (cfg.batch, cfg.seq), device=ctx.device)
    y = torch.randint(0, 256, (cfg.batch, cfg.seq), device=ctx.device)
    reference = copy.deepcopy(base)
    loss = lm_loss(reference(x), y)
    loss.backward()
    ref = {n: p.grad for n, p in reference.named_parameters()} | {"loss": loss.detach()}
    return [check_mode(m, base, x, y, ref, ctx) for m in cfg.modes_for(ctx.world_size)]


def _enough(cfg: TPCheckConfig) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    check((world >= 2, "run it under torchrun with 2 or more processes"),
          ("2-D" not in cfg.modes or _two_d_fits(world),
           f"--modes 2-D needs an even number of processes >= 4, got {world}"),
          # max(1, ...): every rule is computed before the first that fails is reported
          (cfg.heads % max(1, world // 2 if cfg.modes == ("2-D",) else world) == 0,
           f"--heads {cfg.heads} must be a multiple of the tensor-parallel ranks"),
          (cfg.seq % world == 0, f"--seq {cfg.seq} must be a multiple of {world} processes"))


def main(argv: list[str] | None = None) -> None:
    cfg = parse_or_exit(TPCheckConfig, argv, __spec__.name, machine=_enough)
    with distributed(cfg.device) as ctx:
        rows = compare(cfg, ctx)
        if ctx.is_main:
            write_jsonl(cfg.out, rows)


if __name__ == "__main__":
    main()
