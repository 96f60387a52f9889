"""The DDP settings that decide how much of the gradient all-reduce backward can hide.

DDP copies each gradient into a bucket (25 MB by default) and all-reduces a bucket as soon as
backward has filled it, so communication runs beside the rest of backward. On fast GPUs that
overlap is not free: NCCL's kernels occupy streaming multiprocessors and memory bandwidth
that backward's kernels want at the same moment. Three knobs change the trade:

- ``bucket_mb``: fewer, larger buckets mean fewer collectives but a later first one;
- ``bucket_view`` (``gradient_as_bucket_view``): the gradients *are* views into the buckets,
  which saves a copy of every gradient per step and their memory;
- ``bf16_grads``: all-reduce the buckets in bfloat16 (DDP's ``bf16_compress_hook``), half the
  bytes on the wire; each rank's gradient is rounded to bf16 before the sum, the optimizer
  still sees float32 gradients.

How many of the GPU's multiprocessors NCCL may use is set by NCCL itself, through the
``NCCL_MAX_CTAS`` environment variable (read when the communicator is created).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

from tutorial_utils.parallel.ddp import ddp
from tutorial_utils.parallel.distributed import DistContext


@dataclass(frozen=True)
class DDPTuning:
    bucket_mb: float = 25.0  # DDP's default
    bucket_view: bool = False
    bf16_grads: bool = False

    def __post_init__(self) -> None:
        if self.bucket_mb <= 0:
            raise ValueError(f"the DDP bucket size must be > 0 MB, got {self.bucket_mb}")

    def wrap(self, module: nn.Module, ctx: DistContext) -> nn.Module:
        """:func:`~tutorial_utils.parallel.data_parallel.ddp` with these settings."""
        model = ddp(module, ctx, bucket_cap_mb=self.bucket_mb,
                    gradient_as_bucket_view=self.bucket_view)
        if self.bf16_grads and ctx.is_distributed:
            # Registered before the first backward, as DDP requires; state None: the group
            # DDP itself uses.
            model.register_comm_hook(None, bf16_compress_hook)
        return model
