"""``nn.DataParallel``: one process driving several GPUs with one thread each.

In practice use DistributedDataParallel (:mod:`tutorial_utils.parallel.ddp`): one process per
GPU. This module shows what ``nn.DataParallel`` does, because its costs explain why:

- :func:`data_parallel_forward` is one ``nn.DataParallel`` call taken apart (replicate,
  scatter, parallel_apply on one thread per GPU, gather on the first GPU);
- :func:`make_data_parallel` is the heir of the Torch7 post's ``makeDataParallelTable``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import gather, parallel_apply, replicate, scatter

from ..devices import default_device, require_gpus


def data_parallel_forward(
    module: nn.Module, x: torch.Tensor, devices: list[torch.device]
) -> torch.Tensor:
    """One ``nn.DataParallel`` forward, step by step (``module`` lives on ``devices[0]``).

    Every call copies the parameters to every GPU again and starts one Python thread per GPU;
    the outputs (and later the loss) come together on GPU 0, which therefore does more work
    and holds more memory than the others.
    """
    replicas = replicate(module, devices)  # parameters broadcast from devices[0], every step
    chunks = scatter(x, devices)  # split along dim 0, one chunk per GPU
    outputs = parallel_apply(replicas[: len(chunks)], [(c,) for c in chunks], devices=devices)
    return gather(outputs, devices[0])  # concatenated on the first GPU


def make_data_parallel(model: nn.Module, n_gpus: int) -> nn.Module:
    """``nn.DataParallel`` over GPUs 0..n-1 (the model alone on one device when n <= 1).

    The Torch7 helper also re-applied ``cudnn.benchmark`` in every worker thread, because
    those settings were per thread. PyTorch's flag is global, but cuDNN's autotuning cache is
    still per thread, and DataParallel starts fresh threads on every call, so with
    ``torch.backends.cudnn.benchmark = True`` every step can pay for autotuning again.
    """
    if n_gpus <= 1:
        return model.to(default_device())
    devices = require_gpus(n_gpus)
    return nn.DataParallel(model.to(devices[0]), device_ids=[d.index for d in devices])
