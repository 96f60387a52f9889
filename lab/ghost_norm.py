"""Ghost batch normalisation: BatchNorm statistics over small groups of a large batch.

In training, a ``GhostBatchNorm2d`` normalises each group of ``group`` consecutive images with
that group's own mean and variance, as if the batch had been cut into several small ones; its
running statistics average the groups' and evaluation uses them, exactly like ``BatchNorm2d``.
The smaller groups make the statistics noisier, which regularises like a smaller batch would,
without the cost of running one. ``convert_ghost_batchnorm`` swaps it into a built network,
the way ``nn.SyncBatchNorm.convert_sync_batchnorm`` swaps in the synchronised kind.
"""

from __future__ import annotations

import torch
from torch import nn


class GhostBatchNorm2d(nn.BatchNorm2d):
    """``BatchNorm2d`` whose training statistics come from groups of ``group`` images."""

    def __init__(self, num_features: int, group: int, **kwargs) -> None:
        super().__init__(num_features, **kwargs)
        if group < 2:
            raise ValueError(f"a ghost batch needs at least 2 images, got {group}")
        if self.momentum is None or not (self.affine and self.track_running_stats):
            raise ValueError("ghost batch norm needs a momentum, a scale and shift, and "
                             "running statistics (BatchNorm2d's defaults)")
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if not self.training or n == self.group:
            return super().forward(x)
        if n % self.group:
            raise ValueError(f"a batch of {n} does not split into ghost batches of {self.group}")
        # (groups, images, C, H, W); statistics in float32 even when autocast feeds bfloat16
        xg = x.float().unflatten(0, (n // self.group, self.group))
        var, mean = torch.var_mean(xg, dim=(1, 3, 4), unbiased=False, keepdim=True)
        out = ((xg - mean) * torch.rsqrt(var + self.eps)).flatten(0, 1)
        out = out * self.weight.view(1, -1, 1, 1) + self.bias.view(1, -1, 1, 1)
        with torch.no_grad():
            count = self.group * x.shape[2] * x.shape[3]
            self.running_mean.lerp_(mean.mean(0).flatten(), self.momentum)
            self.running_var.lerp_(var.mean(0).flatten() * count / (count - 1), self.momentum)
            self.num_batches_tracked.add_(1)
        return out.to(x.dtype)


def convert_ghost_batchnorm(module: nn.Module, group: int) -> nn.Module:
    """Replace every ``BatchNorm2d`` in ``module`` by a ``GhostBatchNorm2d`` with its state."""
    if isinstance(module, nn.BatchNorm2d) and not isinstance(module, GhostBatchNorm2d):
        ghost = GhostBatchNorm2d(module.num_features, group, eps=module.eps,
                                 momentum=module.momentum, affine=module.affine,
                                 track_running_stats=module.track_running_stats)
        ghost.load_state_dict(module.state_dict())
        return ghost.to(module.running_mean.device)
    for name, child in module.named_children():
        setattr(module, name, convert_ghost_batchnorm(child, group))
    return module
