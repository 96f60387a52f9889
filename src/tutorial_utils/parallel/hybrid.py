"""Several dimensions at once: data x context x pipeline x tensor parallelism on one device mesh.

The N processes are laid out as a 4-D grid, ``dp x cp x pp x tp`` (PyTorch's ``DeviceMesh``),
the fastest-varying dimension last: the ``tp`` ranks of a group are neighbours (on GPUs, the
same machine and NVLink), because tensor parallelism talks in every layer; pipeline neighbours
come next, and data parallelism, which talks once per step, spans the farthest processes.
Each process then holds

- the blocks of its pipeline stage (``pp``; :mod:`.gpt_pipeline`), built alone on the meta
  device and materialised, nothing else;
- of those, its slice of every matrix (``tp``; the plan of :func:`.tensor.block_plan`, and the
  output layer split by vocabulary);
- of those slices, its shard (``dp``; FSDP2, ZeRO-3), whose gradients are reduce-scattered
  over the ``dp`` ranks once per step, after the last micro-batch;
- and its part of the batch: the ``dp`` groups take different sequences.

Context parallelism (``cp``) would split each sequence over its ranks and pass keys and values
around a ring in attention; that attention is written in :mod:`.context`, by hand, and is not
wired into this composition yet: :func:`check_mesh` accepts ``cp = 1`` only (a 4-D mesh with a
context dimension of size 1), and says so in one line otherwise. PyTorch's own
``context_parallel`` replaces the CUDA attention kernels (flash, memory-efficient, cuDNN) and
does not run on CPU processes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from ..config import ConfigError
from ..models.gpt import GPTConfig
from .gpt_pipeline import GPTStage, Pipeline, build_pipeline, check_pipeline
from .tensor import block_plan

DIMS = ("dp", "cp", "pp", "tp")


@dataclass(frozen=True)
class MeshShape:
    """How many processes along each dimension; their product is the number of processes."""

    dp: int = 1
    cp: int = 1
    pp: int = 1
    tp: int = 1

    @property
    def size(self) -> int:
        return self.dp * self.cp * self.pp * self.tp

    def __str__(self) -> str:
        return " x ".join(f"{d}{getattr(self, d)}" for d in DIMS)


def check_mesh(shape: MeshShape, world: int, cfg: GPTConfig, batch: int, micro_batches: int,
               schedule: str = "1f1b", cp_supported: bool = False) -> None:
    """One line (:class:`ConfigError`) for a layout that cannot run, before any work."""
    rules = [
        (min(shape.dp, shape.cp, shape.pp, shape.tp) >= 1,
         f"every mesh dimension must be >= 1, got {shape}"),
        (shape.size == world, f"the mesh {shape} holds {shape.size} processes, not the "
                              f"{world} launched: the product of its sizes must be {world}"),
        (cfg.heads % shape.tp == 0, f"{cfg.heads} heads do not split over tp={shape.tp}: "
                                    "tensor parallelism gives each rank whole heads"),
        (shape.pp <= cfg.layers, f"pp={shape.pp} stages for {cfg.layers} blocks: more stages "
                                 "than blocks"),
        (cfg.seq % (2 * shape.cp) == 0 or shape.cp == 1,
         f"a sequence of {cfg.seq} tokens cannot be split by a ring of cp={shape.cp}: the "
         f"zig-zag split needs a multiple of 2 x cp = {2 * shape.cp}"),
        (shape.cp == 1 or cp_supported,
         f"cp={shape.cp}: context parallelism inside the composed mesh is pending (the ring "
         "attention of parallel/context.py is not wired in yet); use cp=1"),
        (batch % shape.dp == 0, f"a batch of {batch} sequences does not split over "
                                f"dp={shape.dp} groups"),
    ]
    for ok, message in rules:
        if not ok:
            raise ConfigError(message)
    if shape.pp > 1:
        check_pipeline(cfg, shape.pp, schedule, micro_batches, batch // shape.dp)
    elif (batch // shape.dp) % micro_batches:
        raise ConfigError(f"{batch // shape.dp} sequences per dp group do not cut into "
                          f"{micro_batches} micro-batches")


def make_mesh(shape: MeshShape, device_type: str) -> DeviceMesh:
    return init_device_mesh(device_type, (shape.dp, shape.cp, shape.pp, shape.tp),
                            mesh_dim_names=DIMS)


def tp_stage(stage: GPTStage, tp_mesh: DeviceMesh) -> GPTStage:
    """Chapter 7's tensor parallelism on the blocks of one stage (and its output layer, split
    by vocabulary, the logits gathered whole for the loss). Between blocks, and between
    stages, the activations are plain replicated tensors: the pipeline sends those."""
    for block in stage.blocks:
        parallelize_module(block, tp_mesh, block_plan())
    if stage.head is not None:
        parallelize_module(stage.head, tp_mesh, ColwiseParallel(output_layouts=Replicate()))
    return stage


def shard_stage(stage: GPTStage, dp_mesh: DeviceMesh) -> GPTStage:
    """FSDP2 over the ``dp`` ranks: each block one unit, the rest (embedding, norm, head) the
    stage's own. The pipeline schedule holds the gradient reduce-scatter back until a stage's
    last micro-batch."""
    for block in stage.blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(stage, mesh=dp_mesh)
    return stage


@dataclass
class Hybrid:
    """This process's part of the composed model, and where it sits in the mesh."""

    shape: MeshShape
    mesh: DeviceMesh
    pipeline: Pipeline | None  # None when pp = 1
    module: nn.Module | None  # the whole (TP, FSDP) model when pp = 1
    coords: dict[str, int]

    def parameters(self):
        return self.pipeline.parameters() if self.pipeline else self.module.parameters()

    @property
    def holds_loss(self) -> bool:
        """Whether this process computes the loss that counts (last stage, tp rank 0)."""
        last = self.pipeline.has_last if self.pipeline else True
        return last and self.coords["tp"] == 0 and self.coords["cp"] == 0

    def rows(self, batch: int) -> slice:
        """The sequences of the global batch this process's dp group trains on."""
        per = batch // self.shape.dp
        return slice(self.coords["dp"] * per, (self.coords["dp"] + 1) * per)


def build_hybrid(cfg: GPTConfig, shape: MeshShape, device: torch.device, micro_batches: int,
                 schedule: str = "1f1b", seed: int = 0) -> Hybrid:
    """Lay the GPT out over ``shape``: pipeline stages over ``pp``, TP inside each stage over
    ``tp``, FSDP2 over ``dp`` (skipped where dp = 1)."""
    mesh = make_mesh(shape, device.type)
    coords = {d: mesh[d].get_local_rank() for d in DIMS}

    def wrap(stage: GPTStage) -> GPTStage:
        if shape.tp > 1:
            tp_stage(stage, mesh["tp"])
        if shape.dp > 1:
            shard_stage(stage, mesh["dp"])
        return stage

    if shape.pp == 1:
        from .gpt_pipeline import build_stage_module

        module = wrap(build_stage_module(cfg, 0, 1, device, seed))
        return Hybrid(shape, mesh, None, module, coords)
    pipe = build_pipeline(cfg, schedule, coords["pp"], shape.pp, micro_batches, device,
                          group=mesh["pp"].get_group(), seed=seed, wrap=wrap)
    return Hybrid(shape, mesh, pipe, None, coords)
