"""The book's one training step, shared by every chapter and benchmark.

Forward and loss under the book's autocast, one optimizer step, a batch as micro-batches (under
DDP, FSDP2 or neither), and evaluation's forward. It imports torch alone, so that a chapter
timing a step does not load the Wide-ResNet run (:mod:`tutorial_utils.trainer`) built on it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}


def forward_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, precision: str = "bf16",
                 label_smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and cross-entropy loss of one batch, computed the way the whole book trains.

    bf16 autocast: convolutions and matrix products in bf16, reductions (BatchNorm's
    statistics, the loss) in fp32, the weights kept in fp32. Its cache of bf16 weight copies
    is off: each weight is used once per forward, so the cache saves no cast, and a cached copy
    is freed when the region ends while a step recorded as a CUDA graph would still read it.
    ``precision="fp16"`` autocasts to float16 instead (its gradients need a ``GradScaler``: fp16
    is more precise than bf16 but has far less range); ``"fp32"`` does not autocast.
    """
    dtype = AUTOCAST[precision]
    with torch.autocast(x.device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None,
                        cache_enabled=False):
        out = model(x)
        return out, F.cross_entropy(out, y, label_smoothing=label_smoothing)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor,
               y: torch.Tensor, precision: str = "bf16") -> torch.Tensor:
    """One SGD step on ``(x, y)``: forward and loss, backward, update, gradients freed."""
    _, loss = forward_loss(model, x, y, precision)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Reduce the gradients in this backward (``enabled``) or only accumulate them locally:
    DDP's ``no_sync()``, FSDP2's ``set_requires_gradient_sync(False)``; one process has
    nothing to reduce."""
    if enabled:
        yield
    elif isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
    elif isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(False)  # every unit below it too
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def accumulate_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor, k: int,
                         forward_loss: Callable[[torch.Tensor, torch.Tensor], tuple],
                         scale: Callable[[torch.Tensor], torch.Tensor] = lambda loss: loss,
                         ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Forward and backward of ``(x, y)`` as ``k`` micro-batches; the gradients are those of the
    mean loss over the whole batch, reduced across ranks once, in the last backward.

    ``forward_loss(x, y)`` returns (outputs or None, loss); the outputs, detached, and the
    mean loss are returned.
    """
    outs, losses = [], []
    for i, (xi, yi) in enumerate(zip(x.chunk(k), y.chunk(k), strict=True)):
        with gradient_sync(model, enabled=i == k - 1):
            out, loss = forward_loss(xi, yi)
            scale(loss / k).backward()
        if out is not None:
            outs.append(out.detach())
        losses.append(loss.detach())
    return outs, torch.stack(losses).mean()


def accumulate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, k: int,
               precision: str = "bf16", label_smoothing: float = 0.0,
               scale=lambda loss: loss) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward of ``(x, y)`` as ``k`` micro-batches; outputs and mean loss.

    Each micro-batch's loss is divided by ``k``, so the summed gradients are those of the mean
    over the whole batch. Under DDP the first ``k - 1`` backward passes run inside
    ``no_sync()`` (under FSDP2 without gradient sync): the gradients add up locally and are
    reduced once, in the last one. BatchNorm then normalises each micro-batch by its own
    statistics, so with BatchNorm the step is close to, not equal to, one batch of the same
    size. ``scale``: fp16's loss scaling.
    """
    outs, loss = accumulate_gradients(
        model, x, y, k, lambda xi, yi: forward_loss(model, xi, yi, precision, label_smoothing),
        scale)
    return torch.cat(outs), loss


def predict(model: torch.nn.Module, x: torch.Tensor, tta: bool = False) -> torch.Tensor:
    """Logits for ``x``; with ``tta``, plus the logits of its mirror image."""
    out = model(x)
    if not tta:
        return out
    # A CUDA-graph replay returns the same output memory every time: keep the first result.
    return out.clone() + model(torch.flip(x, dims=[3]))
