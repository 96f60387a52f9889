"""Tensor parallelism: one layer's matrices split over N ranks, by hand and with DTensor.

A transformer block is two pairs of matrix products (Shoeybi et al., 2019, Megatron-LM):
attention's ``q``/``k``/``v`` then ``o``, and the MLP's ``fc`` then ``proj``. Split the first of
a pair by its output features (*column-parallel*: each rank computes some heads, or some hidden
units, from the whole input) and the second by its input features (*row-parallel*: each rank
multiplies its own slice and a sum over ranks completes the output). Between the two nothing is
exchanged. Per block that is one all-reduce in forward after each pair, and one in backward
before each pair: 4 of batch x seq x dim values.

- :class:`ColumnParallelLinear` and :class:`RowParallelLinear` do it with explicit collectives
  (:func:`copy_to_ranks`, :func:`sum_over_ranks`), to show where they go;
- :func:`tensor_parallel` does the same with ``parallelize_module``, and optionally sequence
  parallelism (Korthikanti et al., 2022) and a loss computed on the split logits;
- :func:`two_dimensional` adds FSDP2 over a second dimension of the device mesh.

Use :func:`tensor_parallel` in practice: DTensor checkpoints, composes with FSDP2 and checks
layouts. The hand-written layers teach what it does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from ..models.gpt import GPT
from .collectives import bus_factor


class _CopyToRanks(torch.autograd.Function):
    """Forward: the input as it is. Backward: the sum of every rank's gradient for it."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()  # all_reduce writes into its argument
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumOverRanks(torch.autograd.Function):
    """Forward: the sum of every rank's partial output. Backward: the gradient as it is."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_ranks(x: torch.Tensor, group=None) -> torch.Tensor:
    """Megatron's *f*: each rank uses all of ``x``, so ``x``'s gradient sums theirs."""
    return _CopyToRanks.apply(x, group)


def sum_over_ranks(x: torch.Tensor, group=None) -> torch.Tensor:
    """Megatron's *g*: the partial outputs add up to the output; the gradient goes to each."""
    return _SumOverRanks.apply(x, group)


def _slice(t: torch.Tensor, dim: int, group) -> nn.Parameter:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if t.shape[dim] % world:
        raise ValueError(f"{t.shape[dim]} features do not split evenly over {world} ranks")
    return nn.Parameter(t.detach().chunk(world, dim)[rank].clone())


class ColumnParallelLinear(nn.Module):
    """``y_r = x W_r^T + b_r``: this rank's rows of the weight (its output features).

    ``copy_input=False`` leaves out *f*, for layers that share an input that has been through
    it already: one *f* for attention's ``q``, ``k`` and ``v`` sums their gradients once.
    """

    def __init__(self, full: nn.Linear, group=None, copy_input: bool = True) -> None:
        super().__init__()
        self.group, self.copy_input = group, copy_input
        self.weight = _slice(full.weight, 0, group)
        self.bias = None if full.bias is None else _slice(full.bias, 0, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_ranks(x, self.group) if self.copy_input else x
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``y = sum_r x_r W_r^T + b``: this rank's columns of the weight, on its slice of ``x``."""

    def __init__(self, full: nn.Linear, group=None) -> None:
        super().__init__()
        self.group = group
        self.weight = _slice(full.weight, 1, group)
        # one copy of the bias is added after the sum; every rank holds the same one
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = sum_over_ranks(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


def split_by_hand(model: GPT, group=None) -> GPT:
    """Replace each block's linear layers by their column- and row-parallel halves, in place.

    The embeddings, norms and output layer stay whole on every rank: their inputs are the same
    everywhere, so are their gradients, and they need no collective of their own.
    """
    for block in model.blocks:
        attn, mlp = block.attn, block.mlp
        attn.q, attn.k, attn.v = (ColumnParallelLinear(m, group, copy_input=False)
                                  for m in (attn.q, attn.k, attn.v))
        # one f on the input the three projections share: one all-reduce of its gradient
        attn.register_forward_pre_hook(lambda _, args: (copy_to_ranks(args[0], group),))
        attn.o = RowParallelLinear(attn.o, group)
        mlp.fc, mlp.proj = ColumnParallelLinear(mlp.fc, group), RowParallelLinear(mlp.proj, group)
    return model


def block_plan(sequence_parallel: bool = False) -> dict:
    """The plan for one :class:`~tutorial_utils.models.gpt.Block`: which layer splits how.

    With sequence parallelism the norms and the residual stream are split along the sequence
    (``Shard(1)``) between the pairs: each all-reduce becomes an all-gather before a pair and a
    reduce-scatter after it, the same bytes, and the activations outside the pairs shrink N-fold.
    """
    # The attention's input as one DTensor for q, k and v (use_local_output is False): its
    # gradient is then summed (or reduce-scattered) once, not once per projection.
    if not sequence_parallel:
        shared = PrepareModuleInput(input_layouts=(Replicate(),),
                                    desired_input_layouts=(Replicate(),))
        return {"attn": shared, "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
                "attn.v": ColwiseParallel(), "attn.o": RowwiseParallel(),
                "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()}
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return {"norm1": SequenceParallel(), "attn": gather,
            "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.o": RowwiseParallel(output_layouts=Shard(1)),
            "norm2": SequenceParallel(), "mlp": gather,
            "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel(output_layouts=Shard(1))}


def tensor_parallel(model: GPT, mesh: DeviceMesh, sequence_parallel: bool = False,
                    loss_parallel: bool = False) -> GPT:
    """Split ``model`` over the 1-D ``mesh`` with ``parallelize_module``, in place.

    ``loss_parallel``: the output layer keeps its logits split by vocabulary (a DTensor), so
    the loss must run under ``torch.distributed.tensor.parallel.loss_parallel()``; no rank
    then gathers the batch x seq x vocab logits.
    """
    for block in model.blocks:
        parallelize_module(block, mesh, block_plan(sequence_parallel))
    if sequence_parallel:  # the embedding's output enters the first block split by sequence
        parallelize_module(model, mesh, {
            "embed": PrepareModuleOutput(output_layouts=Replicate(),
                                         desired_output_layouts=Shard(1)),
            "norm": SequenceParallel()})
    head_input = Shard(1) if sequence_parallel else Replicate()
    parallelize_module(model.head, mesh, ColwiseParallel(
        input_layouts=head_input, output_layouts=Shard(-1) if loss_parallel else Replicate(),
        use_local_output=not loss_parallel))
    return model


def two_dimensional(model: GPT, mesh: DeviceMesh, *, mp_policy: MixedPrecisionPolicy | None = None,
                    reshard_after_forward: bool = True, **tp_options) -> GPT:
    """Tensor parallelism over ``mesh["tp"]``, then FSDP2 over ``mesh["dp"]``: the usual order,
    as FSDP shards the DTensors TP made. Each block is one FSDP unit, the rest the root's.

    ``mp_policy`` and ``reshard_after_forward`` go to ``fully_shard``; ``tp_options`` to
    :func:`tensor_parallel`.
    """
    tensor_parallel(model, mesh["tp"], **tp_options)
    fsdp = {"mesh": mesh["dp"], "mp_policy": mp_policy or MixedPrecisionPolicy()}
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward, **fsdp)
    fully_shard(model, **fsdp)
    return model


def tp_bytes_per_step(tokens: int, dim: int, layers: int, tp: int, value_bytes: int = 2) -> float:
    """Bytes each rank sends per training step for TP's 4 all-reduces per block of
    ``tokens x dim`` activations (``value_bytes`` each: 2 in bf16)."""
    return 4 * layers * bus_factor("all_reduce", tp) * tokens * dim * value_bytes


def fsdp_bytes_per_step(n_params: int, world: int, value_bytes: int = 4) -> float:
    """Bytes each rank sends per step under FSDP2 (ZeRO-3): the parameters all-gathered for
    forward and again for backward, the gradients reduce-scattered."""
    return 3 * bus_factor("all_gather", world) * n_params * value_bytes


def tp_comm_over_compute(dim: int, tp: int, flops_per_s: float, bus_gbps: float) -> float:
    """TP's all-reduce time over a block's compute time on one rank, whatever the tokens.

    Per token a block does 6 * 12 dim^2 FLOPs (forward and backward, 12 dim^2 parameters),
    split N ways; its 4 all-reduces move 4 * 2 bytes * dim values, times 2(N-1)/N on the bus.
    The tokens cancel: only the hidden size, N and the two rates decide.
    """
    compute_s = 72 * dim**2 / tp / flops_per_s
    comm_s = tp_bytes_per_step(1, dim, 1, tp) / (bus_gbps * 1e9)
    return comm_s / compute_s
