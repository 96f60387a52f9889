"""Several dimensions at once: data x pipeline x context x tensor parallelism on one device mesh.

The N processes are laid out as a 4-D grid, ``dp x pp x cp x tp`` (PyTorch's ``DeviceMesh``),
the fastest-varying dimension last, so that the dimensions that talk most sit closest: the
``tp`` ranks of a group are neighbours (on GPUs, the same machine and NVLink), because tensor
parallelism talks in every layer; the ``cp`` ring comes next (every attention, forward and
backward), then the pipeline (one send per stage and micro-batch), and data parallelism, which
talks once per step, spans the farthest processes (the planner, :mod:`.planner`, assumes the
same order). Each process then holds

- the blocks of its pipeline stage (``pp``; :mod:`.gpt_pipeline`), built alone on the meta
  device and materialised, nothing else;
- of those, its slice of every matrix (``tp``; the plan of :func:`.tensor.block_plan`, and the
  output layer split by vocabulary);
- of those slices, its shard (FSDP2, ZeRO-3) over the ``dp x cp`` ranks together;
- and its part of the batch: the ``dp`` groups take different sequences, and the ``cp`` ranks
  of a group take different tokens of each: the zig-zag slice of :func:`.context.shard`
  (tokens, targets and, for the position embedding, the tokens' places).

Context parallelism (:mod:`.context`) changes only the attention: in every block of a stage it
is the hand-written ring attention over the ``cp`` ranks, on each tp rank's own heads (tensor
parallelism splits the heads, the ring splits the tokens: the two do not meet). Every other
layer works token by token on the rank's slice.

The gradients: the ``cp`` ranks hold the same weights and each computes a share of every
gradient (ring attention's backward sends each rank the gradients of its keys and values that
the other ranks' queries produced), so their sum over ``cp`` is the whole sequence's gradient,
as the sum over ``dp`` is the whole batch's. Both sums are one reduction, so FSDP2 shards the
model over the ``dp x cp`` ranks flattened into one dimension (as torchtitan does). Its
reduce-scatter averages over those ranks, and since every rank holds as many tokens, the
average of their gradients is the gradient of the global batch's mean loss. Flattening uses
``DeviceMesh._flatten``, private: in torch 2.11 and 2.14 there is no public way to make one
dimension of two, and FSDP2 with tensor parallelism needs both meshes cut from the same one.
Sharding over ``dp`` alone and all-reducing over ``cp`` by hand would work too, with ``cp``
times the model state on each rank.

PyTorch's own ``context_parallel`` replaces the CUDA attention kernels (flash,
memory-efficient, cuDNN) and does not run on CPU processes; the hand-written ring does.
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
from .context import positions, shard, split_sequence
from .gpt_pipeline import (
    GPTStage,
    Pipeline,
    build_pipeline,
    build_stage_module,
    check_pipeline,
)
from .tensor import block_plan

DIMS = ("dp", "pp", "cp", "tp")  # the mesh's dimensions, outermost first


@dataclass(frozen=True)
class MeshShape:
    """How many processes along each dimension; their product is the number of processes."""

    dp: int = 1
    pp: int = 1
    cp: int = 1
    tp: int = 1

    @property
    def size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    def __str__(self) -> str:
        return " x ".join(f"{d}{getattr(self, d)}" for d in DIMS)


def check_mesh(shape: MeshShape, world: int, cfg: GPTConfig, batch: int, micro_batches: int,
               schedule: str = "1f1b") -> None:
    """One line (:class:`ConfigError`) for a layout that cannot run, before any work."""
    rules = [
        (min(shape.dp, shape.pp, shape.cp, shape.tp) >= 1,
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
        (batch % shape.dp == 0, f"a batch of {batch} sequences does not split over "
                                f"dp={shape.dp} groups"),
        # ZB-V defers each stage's weight gradients to its own actions, which FSDP2's hooks
        # do not follow: the last stage's block gradients come back empty
        (schedule != "zbv" or shape.pp == 1 or shape.dp * shape.cp == 1,
         f"ZB-V does not run with FSDP2 (dp x cp = {shape.dp * shape.cp}) in this composition: "
         "use the 1f1b or interleaved-1f1b schedule"),
    ]
    for ok, message in rules:
        if not ok:
            raise ConfigError(message)
    if shape.pp > 1:
        check_pipeline(cfg, shape.pp, schedule, micro_batches, batch // shape.dp)
    elif (batch // shape.dp) % micro_batches:
        raise ConfigError(f"{batch // shape.dp} sequences per dp group do not cut into "
                          f"{micro_batches} micro-batches")


def make_mesh(shape: MeshShape, device_type: str) -> tuple[DeviceMesh, DeviceMesh]:
    """The 4-D mesh, and its dp and cp dimensions flattened into one: FSDP2's mesh."""
    mesh = init_device_mesh(device_type, tuple(getattr(shape, d) for d in DIMS),
                            mesh_dim_names=DIMS)
    # every process takes part (it makes process groups); kept, not sliced from the 4-D mesh
    # again by name (PyTorch deprecates that)
    return mesh, mesh["dp", "cp"]._flatten("dp_cp")


def cp_stage(stage: GPTStage, cp_mesh: DeviceMesh, seq: int, device: torch.device) -> GPTStage:
    """Ring attention over the ``cp`` ranks in every block of the stage, and the places in the
    whole sequence of this rank's tokens for the first stage's position embedding."""
    split_sequence(stage, zigzag=True, group=cp_mesh.get_group())
    stage.positions = positions(seq, cp_mesh.get_local_rank(), cp_mesh.size(), zigzag=True,
                                device=device)
    return stage


def tp_stage(stage: GPTStage, tp_mesh: DeviceMesh) -> GPTStage:
    """Chapter 7's tensor parallelism on the blocks of one stage (and its output layer, split
    by vocabulary, the logits gathered whole for the loss). Between blocks, and between
    stages, the activations are plain replicated tensors: the pipeline sends those."""
    for block in stage.blocks:
        parallelize_module(block, tp_mesh, block_plan())
    if stage.head is not None:
        parallelize_module(stage.head, tp_mesh, ColwiseParallel(output_layouts=Replicate()))
    return stage


def shard_stage(stage: GPTStage, shard_mesh: DeviceMesh) -> GPTStage:
    """FSDP2 over ``shard_mesh`` (the ``dp x cp`` ranks): each block one unit, the rest
    (embedding, norm, head) the stage's own. The pipeline schedule holds the gradient
    reduce-scatter back until a stage's last micro-batch."""
    for block in stage.blocks:
        fully_shard(block, mesh=shard_mesh)
    fully_shard(stage, mesh=shard_mesh)
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
        """Whether this process computes a share of the loss that counts (last stage, tp rank
        0): its dp group's mean over its cp rank's tokens. The global batch's loss is the
        mean of those shares over the dp x cp ranks, each holding as many tokens."""
        last = self.pipeline.has_last if self.pipeline else True
        return last and self.coords["tp"] == 0

    def local_batch(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This process's part of global (batch, seq) tensors (tokens, targets): its dp
        group's sequences and, of each, its cp rank's zig-zag slice of the tokens."""
        per = len(tensors[0]) // self.shape.dp
        dp, cp = self.coords["dp"], self.coords["cp"]
        rows = [t[dp * per:(dp + 1) * per] for t in tensors]
        if self.shape.cp == 1:
            return tuple(rows)
        return tuple(shard(t, cp, self.shape.cp, zigzag=True, dim=1) for t in rows)


def build_hybrid(cfg: GPTConfig, shape: MeshShape, device: torch.device, micro_batches: int,
                 schedule: str = "1f1b", seed: int = 0) -> Hybrid:
    """Lay the GPT out over ``shape``: pipeline stages over ``pp``, ring attention over ``cp``
    and TP over ``tp`` inside each stage, FSDP2 over ``dp x cp`` (each skipped where its size
    is 1)."""
    mesh, shard_mesh = make_mesh(shape, device.type)
    coords = {d: mesh[d].get_local_rank() for d in DIMS}

    def wrap(stage: GPTStage) -> GPTStage:
        if shape.cp > 1:
            cp_stage(stage, mesh["cp"], cfg.seq, device)
        if shape.tp > 1:
            tp_stage(stage, mesh["tp"])
        if shape.dp * shape.cp > 1:
            shard_stage(stage, shard_mesh)
        return stage

    if shape.pp == 1:
        module = wrap(build_stage_module(cfg, 0, 1, device, seed))
        return Hybrid(shape, mesh, None, module, coords)
    pipe = build_pipeline(cfg, schedule, coords["pp"], shape.pp, micro_batches, device,
                          group=mesh["pp"].get_group(), seed=seed, wrap=wrap)
    return Hybrid(shape, mesh, pipe, None, coords)
