"""Under torchrun (gloo, 2 processes): gradient accumulation under DDP, clipping under FSDP2.

Rank 0 writes one JSON line to the path given as the only argument:
- ``accum_diff``: the largest gradient difference between DDP with 4 micro-batches per rank
  (``step.accumulate``) and one process on the whole batch;
- ``buckets_k1``, ``buckets_k4``: how many buckets DDP all-reduced in each case (no_sync:
  the same number, once per step);
- ``norm_fsdp``, ``norm_reference``: the global gradient norm ``clip_grad_norm_`` found on
  FSDP2's sharded (DTensor) gradients and on one process's; ``clipped_norm``: the norm of the
  gathered gradients after clipping to 0.01;
- ``sync_bn_error``: what a 2-process ``Trainer`` on the CPU says to ``--sync-bn``;
- ``ghost_weights_diff``, ``ghost_stats_diff``: after three SGD steps, how far one process with
  ``GhostBatchNorm2d`` over groups of 8 of 16 images is from DDP with plain BatchNorm on 8 images
  per rank (weights; rank 0's running statistics); ``whole_weights_diff``: how far plain
  BatchNorm over all 16 is from that DDP run.
"""

import copy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from tutorial_utils.config import ConfigError
from tutorial_utils.data import synthetic_cifar10
from tutorial_utils.jsonl import write_jsonl
from tutorial_utils.models.ghost_bn import ghost_batchnorm
from tutorial_utils.parallel.ddp import ddp
from tutorial_utils.parallel.distributed import distributed
from tutorial_utils.step import accumulate
from tutorial_utils.trainer import TrainConfig, Trainer


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 10))


def ddp_accumulated(ctx, x, y, k):
    model = ddp(net(), ctx)
    calls = []
    model.register_comm_hook(None, lambda state, bucket: (calls.append(1),
                                                          allreduce_hook(state, bucket))[1])
    accumulate(model, x, y, k, "fp32")
    return [p.grad for p in model.parameters()], len(calls)


def bn_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                         nn.Linear(8 * 6 * 6, 10))


def three_steps(model, x, y):
    """The state after three SGD steps on (x, y): weights, then buffers."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(3):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    net = getattr(model, "module", model)
    stats = [b for b in net.buffers() if b.is_floating_point()]
    return [p.detach() for p in net.parameters()], stats


def largest_diff(a, b):
    return max(float((p - q).abs().max()) for p, q in zip(a, b, strict=True))


with distributed("cpu") as ctx:
    torch.manual_seed(1)
    x, y = torch.randn(16, 3, 8, 8), torch.randint(0, 10, (16,))
    mine = slice(ctx.rank * 8, (ctx.rank + 1) * 8)
    reference = net()
    F.cross_entropy(reference(x), y).backward()
    ref = [p.grad for p in reference.parameters()]
    ref_norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in ref])))

    grads, k4 = ddp_accumulated(ctx, x[mine], y[mine], 4)
    _, k1 = ddp_accumulated(ctx, x[mine], y[mine], 1)
    accum_diff = max(float((g - r).abs().max()) for g, r in zip(grads, ref, strict=True))

    sharded = fully_shard(copy.deepcopy(net()), mesh=init_device_mesh("cpu", (2,)))
    F.cross_entropy(sharded(x[mine]), y[mine]).backward()
    norm = float(nn.utils.clip_grad_norm_(sharded.parameters(), 0.01).full_tensor())
    whole = [p.grad.full_tensor() for p in sharded.parameters()]
    clipped = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in whole])))
    data = synthetic_cifar10(256, 64)
    try:
        Trainer(TrainConfig(depth=10, width=1, batch=32, device="cpu", sync_bn=True), ctx, data)
        sync_bn_error = ""
    except ConfigError as err:
        sync_bn_error = str(err)
    ddp_weights, ddp_stats = three_steps(ddp(bn_net(), ctx), x[mine], y[mine])
    ghost_weights, ghost_stats = three_steps(ghost_batchnorm(bn_net(), 8), x, y)
    whole_weights, _ = three_steps(bn_net(), x, y)
    if ctx.is_main:
        write_jsonl(Path(sys.argv[1]), [{"accum_diff": accum_diff, "buckets_k1": k1,
                                         "buckets_k4": k4, "norm_fsdp": norm,
                                         "norm_reference": ref_norm, "clipped_norm": clipped,
                                         "sync_bn_error": sync_bn_error,
                                         "ghost_weights_diff": largest_diff(ghost_weights,
                                                                            ddp_weights),
                                         "ghost_stats_diff": largest_diff(ghost_stats, ddp_stats),
                                         "whole_weights_diff": largest_diff(whole_weights,
                                                                            ddp_weights)}])
