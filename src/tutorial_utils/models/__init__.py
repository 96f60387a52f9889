"""Networks used across the chapters."""

from .ghost_bn import GhostBatchNorm2d, ghost_batchnorm
from .wrn import WideResNet, wide_resnet, wrn_shape

__all__ = ["GhostBatchNorm2d", "WideResNet", "ghost_batchnorm", "wide_resnet", "wrn_shape"]
