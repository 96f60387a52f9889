"""Wide residual networks (Zagoruyko & Komodakis, 2016), the CIFAR variant.

WRN-d-k: depth ``d = 6n + 4`` (n pre-activation basic blocks in each of three groups), width
factor ``k`` (16k, 32k, 64k channels). WRN-28-10 has 36,479,194 parameters.
"""

from __future__ import annotations

import torch
from torch import nn


class BasicBlock(nn.Module):
    """BN-ReLU-conv3x3, (dropout), BN-ReLU-conv3x3, plus a shortcut (1x1 conv if shapes differ)."""

    def __init__(self, c_in: int, c_out: int, stride: int, dropout: float) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm2d(c_in)
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.shortcut = (
            nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False)
            if stride != 1 or c_in != c_out
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        o = torch.relu(self.bn1(x))
        # When the shape changes, the shortcut branches off the pre-activated input, as in
        # the reference implementation.
        skip = x if self.shortcut is None else self.shortcut(o)
        o = self.conv1(o)
        o = self.conv2(self.dropout(torch.relu(self.bn2(o))))
        return o + skip


def init_weights(m: nn.Module) -> None:
    """The reference implementation's initialisation of one module (not its children)."""
    if isinstance(m, nn.Conv2d):
        nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
    elif isinstance(m, nn.BatchNorm2d):
        nn.init.ones_(m.weight)
        nn.init.zeros_(m.bias)
    elif isinstance(m, nn.Linear):
        nn.init.zeros_(m.bias)


class WideResNet(nn.Sequential):
    """A plain ``nn.Sequential``, so it can be split into stages layer by layer."""

    def __init__(
        self, depth: int = 28, width: int = 10, num_classes: int = 10, dropout: float = 0.0
    ) -> None:
        if depth < 10 or (depth - 4) % 6 != 0:
            raise ValueError(
                f"WRN depth must be 6n+4 with n >= 1 (10, 16, 22, 28, 40, ...), got {depth}"
            )
        if width < 1:
            raise ValueError(f"WRN width factor must be >= 1, got {width}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        n = (depth - 4) // 6
        widths = [16, 16 * width, 32 * width, 64 * width]
        layers: list[nn.Module] = [nn.Conv2d(3, widths[0], 3, padding=1, bias=False)]
        for group in range(3):
            for i in range(n):
                c_in = widths[group] if i == 0 else widths[group + 1]
                stride = 2 if (group > 0 and i == 0) else 1
                layers.append(BasicBlock(c_in, widths[group + 1], stride, dropout))
        layers += [
            nn.BatchNorm2d(widths[3]),
            nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(widths[3], num_classes),
        ]
        super().__init__(*layers)
        self.depth, self.width = depth, width
        for m in self.modules():
            init_weights(m)


def wrn_shape(name: str) -> tuple[int, int]:
    """``(depth, width)`` of a WRN's usual name, e.g. ``"wrn-16-4"``; ValueError if it is none."""
    parts = name.lower().split("-")
    if len(parts) != 3 or parts[0] != "wrn" or not (parts[1].isdigit() and parts[2].isdigit()):
        raise ValueError(f"a WRN name looks like 'wrn-28-10' (depth 6n+4, width >= 1), got "
                         f"{name!r}")
    depth, width = int(parts[1]), int(parts[2])
    if depth < 10 or (depth - 4) % 6 or width < 1:
        raise ValueError(f"{name!r}: WRN depth must be 6n+4 (10, 16, 22, 28, 40, ...) and width "
                         ">= 1")
    return depth, width


def wide_resnet(name: str = "wrn-28-10", **kwargs) -> WideResNet:
    """Build a WRN from its usual name, e.g. ``"wrn-16-4"``."""
    return WideResNet(*wrn_shape(name), **kwargs)
