"""Expert parallelism: a mixture of experts spread over N ranks, its tokens sent by all-to-all.

A mixture-of-experts block (:class:`~tutorial_utils.models.gpt.MoE`) holds E expert MLPs, and
a router sends each token to ``top_k`` of them (Shazeer et al., 2017). Its parameters grow with
E, its compute per token does not. Expert parallelism (GShard, Lepikhin et al., 2020) gives
each of N ranks E / N experts; every rank keeps its own tokens (a data-parallel rank) and a copy
of the router. Per block, each rank then:

1. routes its tokens and sorts the (token, expert) assignments by expert, which also sorts them
   by the rank that holds the expert (experts ``r*E/N .. (r+1)*E/N - 1`` live on rank r);
2. tells every rank how many rows it will send for each of its experts (an all-to-all of E
   counts), so that each knows what it will receive;
3. sends the rows (``all_to_all_single`` with those split sizes: uneven, whatever the router
   chose), runs its experts on what arrived, and sends the results back the same way;
4. scales each result by its gate and adds it to its token's output, as one process does.

Backward is two all-to-alls more: each exchange's gradient goes back by the same exchange with
the split sizes swapped (:class:`_AllToAll`). The router's and the rest of the model's gradients
are then summed over the ranks like data parallelism's; each expert's is whole on its rank.

:func:`split_experts` does it by hand to show the mechanism. In practice torchtitan's expert
parallelism and Megatron-LM's MoE layers do the same with grouped GEMMs, a capacity limit or
dropless kernels, and all-to-all overlapped with compute.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..config import check
from ..models.gpt import GPT, MoE, route


def expert_rules(experts: int, top_k: int, world: int,
                 tokens: int | None = None) -> tuple[tuple[bool, str], ...]:
    """What expert parallelism over ``world`` ranks needs, as (holds, message) pairs;
    ``tokens``, where known, is how many one rank routes per block (its batch x sequence)."""
    return ((experts >= 1, f"expert parallelism needs a mixture of experts, got experts="
             f"{experts}"),
            (top_k <= experts, f"top_k={top_k} is more than the {experts} experts: each token "
             "goes to top_k different experts"),
            (experts % world == 0, f"{experts} experts do not split over {world} ranks: use a "
             f"multiple of {world}"),
            (tokens is None or experts <= tokens, f"{experts} experts but {tokens} token(s) per "
             "rank: some experts would get no token at all; route more tokens (batch x seq) or "
             "use fewer experts"))


class _AllToAll(torch.autograd.Function):
    """Rows out by ``send`` sizes (one per rank), rows in by ``receive`` sizes; backward sends
    the gradients back by the same exchange reversed."""

    @staticmethod
    def forward(ctx, x, receive, send, group):
        ctx.sizes, ctx.group = (receive, send), group
        out = x.new_empty(sum(receive), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), receive, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        receive, send = ctx.sizes
        back = grad.new_empty(sum(send), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), send, receive, group=ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, receive: list[int], send: list[int], group=None) -> torch.Tensor:
    """Send ``send[r]`` rows of ``x`` (in order) to each rank r; receive ``receive[r]`` from r."""
    return _AllToAll.apply(x, receive, send, group)


@dataclass
class Dispatch:
    """One block's last dispatch on this rank: what its router chose and what moved."""

    per_expert: list[int]  # this rank's assignments to each of the E experts
    sent: list[int]  # rows sent to each rank (its own included) on the way out
    received: list[int]  # rows received from each rank
    row_bytes: int  # bytes of one row (dim values)

    def bytes_out(self, rank: int) -> int:
        """Bytes this rank sent to other ranks in forward: the rows out, then the results back
        (backward sends as many again)."""
        others = sum(self.sent) - self.sent[rank] + sum(self.received) - self.received[rank]
        return others * self.row_bytes


class ExpertParallelMoE(nn.Module):
    """A :class:`~tutorial_utils.models.gpt.MoE` whose experts are spread over the ranks."""

    def __init__(self, full: MoE, group=None) -> None:
        super().__init__()
        self.group, self.top_k = group, full.top_k
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        self.n_experts, self.local = len(full.experts), len(full.experts) // world
        self.first = rank * self.local  # the global index of this rank's first expert
        self.router = full.router  # every rank routes its own tokens: a copy each
        self.experts = nn.ModuleList(full.experts[self.first:self.first + self.local])
        self.balance_loss, self.last = torch.zeros(()), None

    def __getstate__(self) -> dict:
        return super().__getstate__() | {"balance_loss": torch.zeros(()), "last": None}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        gates, chosen, self.balance_loss = route(self.router(tokens), self.top_k)
        order = chosen.flatten().argsort(stable=True)  # assignments grouped by expert
        rows = order // self.top_k  # the token of each assignment
        per_expert = torch.bincount(chosen.flatten(), minlength=self.n_experts)
        y = self._exchange(tokens[rows], per_expert)
        y = y * gates.flatten()[order, None]
        return torch.zeros_like(tokens).index_add(0, rows, y).view_as(x)

    def _exchange(self, out_rows: torch.Tensor, per_expert: torch.Tensor) -> torch.Tensor:
        """The experts' outputs for ``out_rows`` (sorted by expert), wherever the experts are."""
        # 1. the counts: from each rank, how many rows for each of this rank's experts
        incoming = torch.empty_like(per_expert)
        dist.all_to_all_single(incoming, per_expert, group=self.group)
        world = len(per_expert) // self.local
        send = per_expert.view(world, self.local).sum(1).tolist()  # host sync: sizes needed
        incoming = incoming.view(world, self.local)
        receive = incoming.sum(1).tolist()
        self.last = Dispatch(per_expert.tolist(), send, receive,
                             out_rows.shape[1] * out_rows.element_size())
        # 2. the rows there, 3. through this rank's experts, 4. the results back
        arrived = all_to_all(out_rows, receive, send, self.group)
        return all_to_all(self._run(arrived, incoming), send, receive, self.group)

    def _run(self, arrived: torch.Tensor, incoming: torch.Tensor) -> torch.Tensor:
        """Each local expert on its rows; ``arrived`` holds, for each source rank in turn, its
        rows for expert 0, 1, ... of this rank (``incoming`` counts them)."""
        pieces = list(arrived.split(incoming.flatten().tolist()))
        for j, expert in enumerate(self.experts):
            mine = range(j, len(pieces), self.local)  # expert j's piece from each source
            out = expert(torch.cat([pieces[i] for i in mine]))
            for i, part in zip(mine, out.split([len(pieces[i]) for i in mine]), strict=True):
                pieces[i] = part
        return torch.cat(pieces)


def split_experts(model: GPT, group=None) -> GPT:
    """Replace each block's :class:`MoE` by its expert-parallel share, in place: this rank
    keeps experts ``rank*E/N .. (rank+1)*E/N - 1``; every other parameter stays whole."""
    world, cfg = dist.get_world_size(group), model.cfg
    check(*expert_rules(cfg.experts, cfg.top_k, world))
    for block in model.blocks:
        block.mlp = ExpertParallelMoE(block.mlp, group)
    return model


def expert_of(name: str, rank: int, local: int) -> str:
    """The whole model's name of a parameter of this rank's expert-parallel model:
    ``blocks.0.mlp.experts.1.fc.weight`` on rank 1 of experts 2 per rank is expert 3's."""
    parts = name.split(".")
    if "experts" not in parts:
        return name
    i = parts.index("experts") + 1
    return ".".join([*parts[:i], str(rank * local + int(parts[i])), *parts[i + 1:]])


def predicted_bytes(tokens: int, dim: int, top_k: int, world: int, value_bytes: int = 4) -> float:
    """Bytes one rank sends to the others in forward if the router spreads its ``tokens``
    evenly: each of its ``tokens * top_k`` rows goes to another rank with probability
    (N - 1) / N, and comes back the same way. Backward sends as many again."""
    return 2 * tokens * top_k * dim * value_bytes * (world - 1) / world


def imbalance(per_expert: list[int]) -> float:
    """Tokens of the busiest expert over the mean: 1 is perfect balance. The rank that holds
    the busiest expert sets the pace of every all-to-all and every expert's step."""
    mean = sum(per_expert) / len(per_expert)
    return max(per_expert) / mean if mean else float("nan")

