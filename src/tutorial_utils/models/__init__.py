"""Networks used across the chapters."""

from .wrn import WideResNet, wide_resnet

__all__ = ["WideResNet", "wide_resnet"]
