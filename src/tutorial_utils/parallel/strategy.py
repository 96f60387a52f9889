"""One model, every strategy: the mesh, the wrapping, the step's gradient sync, and clipping.

The training entry point (:mod:`tutorial_utils.train`) trains the Wide-ResNet or the GPT with
``--strategy ddp|fsdp2|hsdp`` and, for the GPT, ``--tp N``. What differs between them is here,
each a short function:

- :func:`build_mesh`: none for DDP; a 1-D mesh for FSDP2; replicate x shard for HSDP (shard
  within a node, replicate across nodes); data x tensor for FSDP2 x TP;
- :func:`wrap_gpt` and :func:`wrap_wrn`: DDP, or ``fully_shard`` on each block (each group of
  residual blocks) and then the root, with a :class:`MixedPrecisionPolicy`; for the GPT with
  ``--tp``, :func:`~tutorial_utils.parallel.tensor.two_dimensional`;
- gradient accumulation is :func:`tutorial_utils.step.accumulate_gradients`: a batch as
  micro-batches, the gradients reduced once, on the last (DDP's ``no_sync``, FSDP2's
  ``set_requires_gradient_sync(False)``);
- :func:`clip_gradients`: the global gradient norm over every shard;
- :func:`broadcast_buffers`: rank 0's BatchNorm statistics to every rank (DDP does it at each
  forward; FSDP2 shards parameters only and leaves each rank its own buffers).

On one process every strategy leaves the model as it is: there is nothing to shard, and the
sharded strategies still checkpoint with DCP (:mod:`tutorial_utils.sharded_checkpoint`), so a
job of another size can resume them.
"""

from __future__ import annotations

import os
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from ..config import ConfigError
from .ddp import ddp
from .distributed import DistContext

Strategy = Literal["ddp", "fsdp2", "hsdp"]
SHARDED = ("fsdp2", "hsdp")  # checkpointed with DCP, one shard file per rank


def shard_size(requested: int | None) -> int:
    """HSDP's shard dimension: ``requested``, else the processes of one node (torchrun's
    LOCAL_WORLD_SIZE): parameters sharded over a node's fast links, replicated across nodes."""
    return requested or int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))


def check_layout(strategy: Strategy, world: int, shard: int | None = None, tp: int = 1) -> None:
    """Raise :class:`ConfigError` (one line, what to do) unless the mesh splits ``world``."""
    def divisors() -> str:
        return ", ".join(str(d) for d in range(1, world + 1) if world % d == 0)

    processes = f"{world} process{'es' if world > 1 else ''}"
    if tp > 1 and world % tp:
        raise ConfigError(f"--tp {tp} does not divide the {processes}; run a multiple of {tp} "
                          f"processes, or use a --tp that divides {world} ({divisors()})")
    if strategy == "hsdp" and world % shard_size(shard):
        raise ConfigError(f"--strategy hsdp --shard-size {shard_size(shard)}: the mesh's shard "
                          f"dimension must divide the {processes}; use --shard-size "
                          f"{divisors().replace(', ', ' or ')}")


def build_mesh(ctx: DistContext, strategy: Strategy, shard: int | None = None,
               tp: int = 1) -> DeviceMesh | None:
    """The device mesh of ``strategy``: None for DDP or a single process."""
    check_layout(strategy, ctx.world_size, shard, tp)
    kind, world = ctx.device.type, ctx.world_size
    if not ctx.is_distributed or strategy == "ddp":
        return None
    if tp > 1:  # consecutive ranks (one node's GPUs) form a tensor-parallel group
        return init_device_mesh(kind, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    if strategy == "hsdp":  # consecutive ranks share a shard group, the groups replicate
        n = shard_size(shard)
        return init_device_mesh(kind, (world // n, n), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(kind, (world,), mesh_dim_names=("shard",))


def data_parallel_rank(ctx: DistContext, mesh: DeviceMesh | None) -> tuple[int, int]:
    """(which slice of the global batch this rank takes, how many slices): the ranks of one
    tensor-parallel group compute on the same data; every other layout gives each rank its own."""
    if mesh is not None and "tp" in (mesh.mesh_dim_names or ()):
        return mesh["dp"].get_local_rank(), mesh["dp"].size()
    return ctx.rank, ctx.world_size


def precision_policy(device: torch.device, precision: str) -> MixedPrecisionPolicy:
    """bf16 parameters for the forward and backward on a GPU, gradients reduced in fp32; on
    CPU processes fp32 throughout (their bf16 arithmetic is emulated, or autocast's)."""
    if device.type == "cuda" and precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def wrap_gpt(model: nn.Module, ctx: DistContext, mesh: DeviceMesh | None, *,
             policy: MixedPrecisionPolicy, reshard_after_forward: bool = True) -> nn.Module:
    """DDP without a mesh; with one, each block an FSDP2 unit and the rest the root's (over the
    data dimension, after tensor parallelism over ``mesh["tp"]`` if the mesh has one)."""
    if mesh is None:
        return ddp(model, ctx)
    if "tp" in (mesh.mesh_dim_names or ()):
        from .tensor import two_dimensional

        return two_dimensional(model, mesh, mp_policy=policy,
                               reshard_after_forward=reshard_after_forward)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy,
                    reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy)  # embeddings, final norm, output layer
    return model


def wrap_wrn(net: nn.Module, ctx: DistContext, mesh: DeviceMesh | None, *,
             policy: MixedPrecisionPolicy, reshard_after_forward: bool = True) -> nn.Module:
    """FSDP2 (or HSDP, by the mesh) over a Wide-ResNet: a unit per group of residual blocks,
    then the root (:func:`tutorial_utils.parallel.fsdp.shard`). The weights must be contiguous:
    FSDP2 flattens each parameter into its shard, which a channels_last weight is not."""
    from .fsdp import shard

    if mesh is None:
        return net
    return shard(net, ctx, mesh=mesh, mp_policy=policy,
                 reshard_after_forward=reshard_after_forward)


def clip_gradients(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Scale the gradients so that their global L2 norm is at most ``max_norm``; the norm.

    Under FSDP2 each rank holds a shard of each gradient (a DTensor), whose norm is reduced
    over its mesh: ``clip_grad_norm_`` works as it is. With FSDP2 x TP the parameters live on
    two meshes (the blocks' on data x tensor, the embeddings' on data alone), which one fused
    operation cannot mix: the squared norms are summed per mesh, then together, and each
    mesh's gradients scaled on their own.
    """
    by_mesh: dict[object, list[nn.Parameter]] = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group])
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return torch.zeros(())
    total = norms[0] if len(norms) == 1 else torch.stack(norms).square().sum().sqrt()
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


@torch.no_grad()
def broadcast_buffers(model: nn.Module, ctx: DistContext) -> None:
    """Copy rank 0's buffers (BatchNorm's running statistics) into every rank, as DDP does
    before each forward: under FSDP2 each rank's statistics follow its own batches."""
    if ctx.is_distributed:
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)
