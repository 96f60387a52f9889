"""Sharded data parallelism: the ZeRO stages, and FSDP2 (``fully_shard``) set up for a Wide-ResNet.

DDP replicates parameters, gradients and optimizer state on every GPU. ZeRO (Rajbhandari et
al., 2020) shards them across the N GPUs in three stages, and PyTorch has each one:

- stage 1, the optimizer state: ``ZeroRedundancyOptimizer`` over DDP;
- stage 2, + the gradients: ``fully_shard(reshard_after_forward=False)`` comes closest; it keeps
  the gathered parameters from forward to backward, so it all-gathers them once per step;
- stage 3, + the parameters: ``fully_shard`` (the default), which all-gathers each unit's
  parameters before its forward and again before its backward.

:func:`tutorial_utils.memory.zero_table` is the paper's memory model; :func:`shard` applies
FSDP2 and :func:`local_bytes` measures what one rank holds. Checkpoints of the sharded state are
in :mod:`tutorial_utils.sharded_checkpoint`.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from ..models.wrn import BasicBlock, WideResNet
from .distributed import DistContext

Units = Literal["model", "group", "block"]


def wrn_units(model: WideResNet, units: Units) -> list[list[nn.Module]]:
    """The residual blocks of each FSDP unit besides the root, in forward order."""
    blocks = [m for m in model if isinstance(m, BasicBlock)]
    n = {"model": 0, "group": (model.depth - 4) // 6, "block": 1}.get(units)
    if n is None:
        raise ValueError(f"units must be 'model', 'group' or 'block', got {units!r}")
    return [blocks[i : i + n] for i in range(0, len(blocks), n)] if n else []


def shard(model: WideResNet, ctx: DistContext, *, units: Units = "group",
          reshard_after_forward: bool = True, prefetch: bool = False,
          compile_blocks: bool = False, mesh: DeviceMesh | None = None,
          mp_policy: MixedPrecisionPolicy | None = None) -> nn.Module:
    """FSDP2 for a WRN: a unit per group of residual blocks (or per block, or none), then the root.

    Units: each costs host time on every step (Python hooks around its forward and backward,
    a collective each way), and a WRN-28-10 step at 128 images per GPU is short enough for
    the host to limit it. Three units plus the root (stem and head) run a third of the hooks
    of one per block (12 + 1); the price is memory, as a unit is gathered whole (the last
    group holds three quarters of the parameters). ``"model"`` leaves the root alone: the
    fewest hooks, but the whole model is gathered at once and nothing overlaps that.

    ``reshard_after_forward=False`` (ZeRO-2-like) keeps each unit gathered from its forward
    to its backward: one all-gather per step instead of two, less host work, and the memory
    of all the unsharded parameters during the step. ``prefetch`` issues the next unit's
    all-gather earlier from the CPU (FSDP overlaps it with compute anyway), which helps only
    when the CPU runs ahead of the GPU. ``compile_blocks`` compiles each block before it is
    sharded, so FSDP's hooks stay outside the compiled code.

    Precision: ``mp_policy`` (default: none). The caller runs bf16 autocast over the fp32
    parameters, as it does for DDP, so both compute the same thing. A bf16 ``param_dtype``
    would gather half the bytes (for WRN-28-10 on two GPUs, 73 MB less per step: a fraction
    of a millisecond over NVLink), but BatchNorm's weights and running statistics must stay
    fp32, i.e. 25 more units of their own. The cost of autocast: its bf16 copy of each weight
    lives from forward to backward, unsharded (2 bytes per parameter). ``mesh``: 1-D (FSDP2;
    default: every process) or replicate x shard (HSDP).
    """
    if not dist.is_initialized():  # FSDP2 needs a process group (one process may form one)
        if compile_blocks:
            compile_blocks_of([model])
        return model
    mesh = mesh if mesh is not None else init_device_mesh(ctx.device.type, (ctx.world_size,))
    policy = mp_policy or MixedPrecisionPolicy()
    groups = wrn_units(model, units)
    for group in groups:
        if compile_blocks:
            compile_blocks_of(group)
        fully_shard(group if len(group) > 1 else group[0], mesh=mesh,
                    reshard_after_forward=reshard_after_forward, mp_policy=policy)
    # The root's forward ends the forward pass and its backward starts the backward pass:
    # FSDP keeps its parameters gathered in between.
    fully_shard(model, mesh=mesh, mp_policy=policy)
    heads = [group[0] for group in groups]  # a list unit's state lives on its first module
    if prefetch and len(heads) > 1 and hasattr(heads[0], "set_modules_to_forward_prefetch"):
        for this, after in zip(heads, heads[1:], strict=False):
            this.set_modules_to_forward_prefetch([after])
            after.set_modules_to_backward_prefetch([this])
    return model


def compile_blocks_of(modules) -> None:
    """``torch.compile`` every residual block in place (the module tree and names unchanged).

    ``dynamic=False``: the blocks share one ``forward``, so from the second shape on, dynamo
    would otherwise compile it for symbolic sizes, kernels that suit every block and none well.
    """
    for m in modules:
        for block in (b for b in m.modules() if isinstance(b, BasicBlock)):
            block.compile(dynamic=False)


def local_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds for parameters, gradients and optimizer state (its shards only)."""
    def size(t: torch.Tensor) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: this rank's shard
        return t.numel() * t.element_size()

    params = list(model.parameters())
    # ZeroRedundancyOptimizer keeps this rank's part of the state in its local ``optim``.
    state = getattr(optimizer, "optim", optimizer).state
    tensors = [v for s in state.values() for v in s.values() if torch.is_tensor(v)]
    return {"params": sum(size(p) for p in params),
            "grads": sum(size(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(size(v) for v in tensors)}
