"""The original post's toy network: two 3->3 convolutions (kernel 5 high, 3 wide), each + ReLU.

Torch7's ``nn.SpatialConvolution(3, 3, 3, 5)`` takes (nIn, nOut, kW, kH); PyTorch's
``nn.Conv2d`` takes ``kernel_size=(kH, kW)``, hence ``(5, 3)`` below.
"""

from __future__ import annotations

import torch
from torch import nn

INPUT_SHAPE = (16, 3, 10, 10)
KERNEL_HW = (5, 3)


def toy_model(device: torch.device | str = "cpu") -> nn.Sequential:
    """The post's ``nn.Sequential`` of two conv + in-place ReLU pairs."""
    return nn.Sequential(
        nn.Conv2d(3, 3, kernel_size=KERNEL_HW),
        nn.ReLU(inplace=True),
        nn.Conv2d(3, 3, kernel_size=KERNEL_HW),
        nn.ReLU(inplace=True),
    ).to(device)


def toy_input(generator: torch.Generator | None = None) -> torch.Tensor:
    """A 16x3x10x10 float tensor of integers drawn uniformly from 0..255, like the post's."""
    return torch.randint(0, 256, INPUT_SHAPE, generator=generator).float()


def toy_grad_output(shape: torch.Size, generator: torch.Generator | None = None) -> torch.Tensor:
    """The post's stand-in for a loss gradient: uniform noise in [-0.1, 0.1]."""
    return torch.empty(shape).uniform_(-0.1, 0.1, generator=generator)


def toy_output_shape(input_shape: tuple[int, ...] = INPUT_SHAPE) -> tuple[int, ...]:
    """Shape after two unpadded (5, 3) convolutions: each removes 4 rows and 2 columns."""
    n, _, h, w = input_shape
    kh, kw = KERNEL_HW
    return (n, 3, h - 2 * (kh - 1), w - 2 * (kw - 1))
