"""BatchNorm over groups of a batch: what few images per GPU do to BatchNorm, on one GPU.

With DDP and plain BatchNorm each GPU normalises its own images: on 8 GPUs with 16 images each,
the statistics of every layer come from 16 images, not from the 128 of the step (Hoffer et al.,
2017, call the groups "ghost batches"). :class:`GhostBatchNorm2d` does the same to one GPU's
batch, so the effect can be measured without the GPUs; ``--sync-bn`` is the cure it motivates.
"""

from __future__ import annotations

import torch
from torch import nn


class GhostBatchNorm2d(nn.BatchNorm2d):
    """``nn.BatchNorm2d`` whose training statistics are those of each group of ``group``
    consecutive images, as on ``batch / group`` GPUs each holding one group.

    The running statistics come from the first group only, as under DDP, which broadcasts rank
    0's buffers to the others before each forward. In evaluation it is ``nn.BatchNorm2d``
    (which, without running statistics, normalises by the batch's: then by each group's).
    """

    def __init__(self, num_features: int, group: int, **kwargs) -> None:
        super().__init__(num_features, **kwargs)
        if group < 2:
            raise ValueError(f"a group needs at least two images for a variance, got {group}")
        self.group = group

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group={self.group}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        running = not self.training and self.track_running_stats  # no batch statistics
        if running or n <= self.group:
            return super().forward(x)
        if n % self.group:
            raise ValueError(f"a batch of {n} images does not split into groups of {self.group}")
        # bf16 and fp16 activations are normalised in fp32, as nn.BatchNorm2d does
        g = x.to(torch.promote_types(x.dtype, torch.float32))
        g = g.reshape(n // self.group, self.group, *x.shape[1:])
        var, mean = torch.var_mean(g, dim=(1, 3, 4), correction=0, keepdim=True)
        y = (g - mean) * torch.rsqrt(var + self.eps)
        if self.affine:
            y = y * self.weight.view(1, 1, -1, 1, 1) + self.bias.view(1, 1, -1, 1, 1)
        if self.training and self.track_running_stats:
            per_channel = self.group * x.shape[2] * x.shape[3]  # values behind each statistic
            self._update_running_stats(mean[0].flatten(), var[0].flatten(), per_channel)
        return y.reshape(x.shape).to(x.dtype)

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, m: int) -> None:
        """What ``nn.BatchNorm2d`` does with the statistics of ``m`` values per channel: a
        moving average (or, with ``momentum=None``, the mean so far), the variance unbiased."""
        self.num_batches_tracked.add_(1)
        weight = 1.0 / self.num_batches_tracked if self.momentum is None else self.momentum
        dtype = self.running_mean.dtype  # the buffers' own, whatever the activations'
        self.running_mean.lerp_(mean.to(dtype), weight)
        self.running_var.lerp_((var * (m / (m - 1))).to(dtype), weight)


def ghost_batchnorm(model: nn.Module, group: int) -> nn.Module:
    """``model`` with each ``nn.BatchNorm2d`` replaced in place by a :class:`GhostBatchNorm2d`
    of ``group`` images holding the same weights and statistics (a ``model`` that is itself a
    ``nn.BatchNorm2d`` is returned converted)."""
    if type(model) is nn.BatchNorm2d:
        tensors = [*model.parameters(), *model.buffers()]
        place = dict(device=tensors[0].device, dtype=tensors[0].dtype) if tensors else {}
        ghost = GhostBatchNorm2d(model.num_features, group, eps=model.eps,
                                 momentum=model.momentum, affine=model.affine,
                                 track_running_stats=model.track_running_stats, **place)
        ghost.load_state_dict(model.state_dict())
        return ghost
    for name, child in model.named_children():
        setattr(model, name, ghost_batchnorm(child, group))
    return model
