"""Networks used across the chapters."""

from .wrn import WideResNet, wide_resnet, wrn_shape

__all__ = ["WideResNet", "wide_resnet", "wrn_shape"]
