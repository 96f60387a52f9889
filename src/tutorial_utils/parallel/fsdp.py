"""Sharded data parallelism with FSDP2 (``fully_shard``), and a DDP comparison under torchrun.

DDP keeps a full copy of the parameters, gradients and optimizer state on every GPU. FSDP
shards all three across the GPUs: each holds 1/N, gathers a block's full parameters just
before using them (all-gather) and scatters gradients back to their owners (reduce-scatter).
That trades more communication for memory; it pays when the replicated state, not the
activations, is what does not fit. :mod:`tutorial_utils.workers.fsdp_step` measures both.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from ..models.wrn import BasicBlock
from .distributed import DistContext


def shard(model: nn.Module, ctx: DistContext) -> nn.Module:
    """FSDP2: each residual block is one unit of all-gather / reduce-scatter, then the rest."""
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    for block in model.modules():
        if isinstance(block, BasicBlock):
            fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def local_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds for parameters, gradients and optimizer state (its shards only)."""
    def size(t: torch.Tensor) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return {"params": sum(size(p) for p in params),
            "grads": sum(size(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(size(v) for v in state)}
