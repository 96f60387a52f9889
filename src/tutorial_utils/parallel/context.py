"""Context parallelism: a long sequence split over N ranks, its attention computed in a ring.

Each of N ranks holds S / N of the sequence's tokens. Everything in a transformer block but
attention works token by token, so it runs on a rank's slice as it is; attention needs every
earlier key for each query. Ring attention (Liu et al., 2023) passes the key and value blocks
around the ring of ranks: at step i rank r holds rank (r - i)'s block, computes its own queries
against it, and meanwhile sends that block on to rank r + 1 and receives the next from r - 1.
After N steps every query has met every key, and no rank held more than two blocks at a time.

The softmax over keys that never sit in one place is combined online (Milakov & Gimelshein,
2018; FlashAttention, Dao et al., 2022). For one query, with scores ``s_j = q.k_j / sqrt(d)``,
keep the running max ``m``, the running sum ``l`` of ``exp(s_j - m)`` and the unnormalised
output ``a``. A new block of scores ``s_B`` with values ``v_B`` updates them:

    m' = max(m, max_j s_Bj)
    l' = l * exp(m - m') + sum_j exp(s_Bj - m')
    a' = a * exp(m - m') + sum_j exp(s_Bj - m') v_Bj

and after the last block ``o = a / l`` is ``softmax(s) V`` over all the keys: the factor
``exp(m - m')`` rescales what was summed under the old max to the new one, and subtracting the
max keeps every exponential at most 1. The log-sum-exp ``L = m + log l`` is kept for backward,
which recomputes each block's probabilities ``P = exp(s - L)`` and, with ``D = rowsum(dO * O)``,

    dV_B += P^T dO,   dS = P * (dO V_B^T - D),   dQ += dS K_B / sqrt(d),   dK_B += dS^T Q / sqrt(d).

In backward (:class:`RingAttention`, by hand) the key and value blocks go around the ring once
more, their gradients travelling with them, each rank adding its queries' share; one last hop
brings each block's gradients home. Autograd cannot do it alone: point-to-point sends have no
backward.

The causal mask lets a query see only keys at or before its position. Cut the sequence into N
slices in order and rank r's queries see the blocks of ranks 0..r only: the last rank computes
N times what the first does, and every step waits for the slowest. Zig-zag (``zigzag=True``,
as Llama 3 was trained) cuts it into 2N chunks and gives rank r chunks r and 2N - 1 - r, one
early and one late: every rank then computes the same number of chunk pairs, 2N + 1
(:func:`causal_blocks`).

- :func:`ring_attention`: the ring, by hand; :func:`gathered_attention`: the naive route, each
  rank gathers all the keys and values (one collective, N times the memory);
- :func:`pytorch_ring`: PyTorch's ``context_parallel`` (experimental) on GPUs, around SDPA's
  flash or efficient kernels, zig-zag included; it exchanges keys and values by all-gather by
  default, or around a ring after ``set_rotate_method("alltoall")``. Use it (torchtitan wraps
  it) in practice; the hand-written ring shows what it does.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..config import ConfigError, check
from ..models.gpt import GPT


def _rank_world(group) -> tuple[int, int]:
    if not dist.is_initialized():  # one process, no group: the ring is one rank
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def check_split(seq: int, world: int, zigzag: bool) -> None:
    """ConfigError unless ``seq`` tokens split evenly over ``world`` ranks (in 2N chunks with
    zig-zag)."""
    pieces = 2 * world if zigzag else world
    how = f" in {pieces} zig-zag chunks" if zigzag else ""
    check((seq % pieces == 0, f"a sequence of {seq} tokens does not split over {world} ranks"
           f"{how}: use a multiple of {pieces}"))


def chunks_of(rank: int, world: int, zigzag: bool) -> tuple[int, ...]:
    """Which chunks of the sequence ``rank`` holds: its slice, or chunks r and 2N - 1 - r."""
    return (rank, 2 * world - 1 - rank) if zigzag else (rank,)


def shard(x: torch.Tensor, rank: int, world: int, zigzag: bool, dim: int = 2) -> torch.Tensor:
    """This rank's tokens of the whole ``x`` (sequence along ``dim``), its chunks in order."""
    check_split(x.shape[dim], world, zigzag)
    parts = x.chunk(2 * world if zigzag else world, dim)
    return torch.cat([parts[c] for c in chunks_of(rank, world, zigzag)], dim)


def unshard(shards: list[torch.Tensor], zigzag: bool, dim: int = 2) -> torch.Tensor:
    """The whole sequence from every rank's shard (rank order), chunks put back in place."""
    world, pieces = len(shards), {}
    for rank, s in enumerate(shards):
        own = chunks_of(rank, world, zigzag)
        pieces |= dict(zip(own, s.chunk(len(own), dim), strict=True))
    return torch.cat([pieces[c] for c in sorted(pieces)], dim)


def positions(seq: int, rank: int, world: int, zigzag: bool, device=None) -> torch.Tensor:
    """Where in the whole sequence each of this rank's tokens stands."""
    return shard(torch.arange(seq, device=device), rank, world, zigzag, dim=0)


def block_pairs(rank: int, source: int, world: int,
                zigzag: bool) -> list[tuple[int, int, bool]]:
    """The (query chunk, key chunk, diagonal) pairs ``rank`` computes with ``source``'s block:
    local chunk indices, and whether the causal mask cuts the pair in two. A key chunk after a
    query chunk is skipped: the mask hides all of it."""
    mine, theirs = chunks_of(rank, world, zigzag), chunks_of(source, world, zigzag)
    return [(i, j, a == b) for i, a in enumerate(mine) for j, b in enumerate(theirs) if b <= a]


def causal_blocks(rank: int, world: int, zigzag: bool) -> int:
    """Chunk pairs ``rank`` computes over the whole ring: r + 1 slices in order (rank N - 1
    does N times rank 0's work), 2N + 1 half-size chunks with zig-zag on every rank."""
    return sum(len(block_pairs(rank, s, world, zigzag)) for s in range(world))


def _peer(rank: int, group) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _pass(tensors: list[torch.Tensor], group, tag: int):
    """Send ``tensors`` to the next rank and receive as many from the previous, started."""
    rank, world = _rank_world(group)
    to, source = _peer((rank + 1) % world, group), _peer((rank - 1) % world, group)
    received = [torch.empty_like(t) for t in tensors]
    ops = ([dist.P2POp(dist.isend, t, to, group, tag) for t in tensors]
           + [dist.P2POp(dist.irecv, t, source, group, tag) for t in received])
    return dist.batch_isend_irecv(ops), received


def _arrived(pending) -> list[torch.Tensor]:
    requests, received = pending
    for request in requests:
        request.wait()
    return received


def _ring(k: torch.Tensor, v: torch.Tensor, group) -> Iterator[tuple[int, torch.Tensor,
                                                                   torch.Tensor]]:
    """The (source rank, keys, values) this rank holds in turn: its own, then rank - 1's, ...
    Each next block travels while the caller computes with the current one."""
    rank, world = _rank_world(group)
    for step in range(world):
        pending = _pass([k, v], group, tag=0) if step < world - 1 else None
        yield (rank - step) % world, k, v
        if pending is not None:
            k, v = _arrived(pending)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, diagonal: bool) -> torch.Tensor:
    s = q @ k.transpose(-2, -1) * scale
    if diagonal:  # the same chunk of positions: a key after the query is hidden
        hidden = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(hidden, float("-inf"))
    return s


class OnlineSoftmax:
    """``softmax(s) V`` for a block of queries, over key blocks that arrive one at a time."""

    def __init__(self, q: torch.Tensor) -> None:
        self.m = q.new_full(q.shape[:-1], float("-inf"))  # running max of the scores
        self.l = q.new_zeros(q.shape[:-1])  # running sum of exp(s - m)
        self.a = torch.zeros_like(q)  # running sum of exp(s - m) v

    def update(self, s: torch.Tensor, v: torch.Tensor) -> None:
        m = torch.maximum(self.m, s.amax(-1))
        p, rescale = torch.exp(s - m[..., None]), torch.exp(self.m - m)
        self.l = self.l * rescale + p.sum(-1)
        self.a = self.a * rescale[..., None] + p @ v
        self.m = m

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The output and the log-sum-exp of each query's scores."""
        return self.a / self.l[..., None], self.m + self.l.log()


def _ring_forward(q, k, v, zigzag: bool, group) -> tuple[torch.Tensor, torch.Tensor]:
    rank, world = _rank_world(group)
    n, scale = len(chunks_of(rank, world, zigzag)), q.shape[-1] ** -0.5
    queries = q.chunk(n, 2)
    softmax = [OnlineSoftmax(c) for c in queries]
    for source, kk, vv in _ring(k, v, group):
        keys, values = kk.chunk(n, 2), vv.chunk(n, 2)
        for i, j, diagonal in block_pairs(rank, source, world, zigzag):
            softmax[i].update(_scores(queries[i], keys[j], scale, diagonal), values[j])
    out, lse = zip(*(s.result() for s in softmax), strict=True)
    return torch.cat(out, 2), torch.cat(lse, 2)


def _ring_backward(dout, q, k, v, out, lse, zigzag: bool, group):
    rank, world = _rank_world(group)
    n, scale = len(chunks_of(rank, world, zigzag)), q.shape[-1] ** -0.5
    queries, douts, lses = q.chunk(n, 2), dout.chunk(n, 2), lse.chunk(n, 2)
    deltas = (dout * out).sum(-1).chunk(n, 2)
    dq = torch.zeros_like(q)
    dkv = torch.zeros(2, *k.shape, dtype=k.dtype, device=k.device)  # travels with the block
    for source, kk, vv in _ring(k, v, group):
        keys, values = kk.chunk(n, 2), vv.chunk(n, 2)
        dqs, dks, dvs = dq.chunk(n, 2), dkv[0].chunk(n, 2), dkv[1].chunk(n, 2)
        for i, j, diagonal in block_pairs(rank, source, world, zigzag):
            p = torch.exp(_scores(queries[i], keys[j], scale, diagonal) - lses[i][..., None])
            dvs[j].add_(p.transpose(-2, -1) @ douts[i])
            ds = p * (douts[i] @ values[j].transpose(-2, -1) - deltas[i][..., None])
            dqs[i].add_(ds @ keys[j] * scale)
            dks[j].add_(ds.transpose(-2, -1) @ queries[i] * scale)
        if world > 1:  # on to the rank that holds the block next; after N hops, home
            dkv = _arrived(_pass([dkv], group, tag=1))[0]
    return dq, dkv[0], dkv[1]


class RingAttention(torch.autograd.Function):
    """Causal attention with the keys and values passed around the ring, forward and backward
    by hand. Computes in fp32 whatever the inputs' precision; saves for backward only this
    rank's q, k, v, output and log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, zigzag, group):
        q, k, v = (t.contiguous() for t in (q, k, v))
        out, lse = _ring_forward(q.float(), k.float(), v.float(), zigzag, group)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.zigzag, ctx.group = zigzag, group
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        grads = _ring_backward(dout.float().contiguous(), q.float(), k.float(), v.float(),
                               out.float(), lse, ctx.zigzag, ctx.group)
        return *(g.to(t.dtype) for g, t in zip(grads, (q, k, v), strict=True)), None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, zigzag: bool = False,
                   group=None) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence's keys.

    ``q``, ``k``, ``v``: (batch, heads, S / N, head_dim), this rank's tokens (:func:`shard`);
    returns this rank's rows of the output. Without a process group it is one rank's ring.
    """
    return RingAttention.apply(q, k, v, zigzag, group)


class _GatherSequence(torch.autograd.Function):
    """Forward: every rank's slice, in rank order along the sequence. Backward: the sum over
    the ranks of their gradients for this rank's slice (a reduce-scatter; gloo has none, so an
    all-reduce and a slice here, twice the bytes)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, (ctx.rank, ctx.world) = group, _rank_world(group)
        parts = [torch.empty_like(x) for _ in range(ctx.world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, 2)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(ctx.world, 2)[ctx.rank], None


def gathered_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, zigzag: bool = False,
                       group=None) -> torch.Tensor:
    """The naive route, as :func:`ring_attention` takes and returns: gather every rank's keys
    and values, then attend with a mask built from the tokens' positions. Each rank holds the
    whole sequence's keys and values, and keeps them for backward."""
    rank, world = _rank_world(group)
    if world == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    seq = q.shape[2] * world
    mine = positions(seq, rank, world, zigzag, q.device)
    every = torch.cat([positions(seq, r, world, zigzag, q.device) for r in range(world)])
    keys, values = (_GatherSequence.apply(t, group) for t in (k, v))
    return F.scaled_dot_product_attention(q, keys, values,
                                          attn_mask=mine[:, None] >= every[None, :])


@contextlib.contextmanager
def pytorch_ring(mesh, seq: int, device: torch.device) -> Iterator[None]:
    """Inside, causal SDPA on this rank's shards (:func:`shard` with ``zigzag=True``) is
    PyTorch's context-parallel attention: run forward and backward inside.

    ``context_parallel`` (experimental) swaps SDPA for its own on the 1-D ``mesh`` (keys and
    values all-gathered by default, passed around a ring with ``alltoall`` rotation) and
    shards, in place along the sequence, the buffers it is given (a training loop gives it the
    batch's tokens and targets); from them it learns the sequence's length and balances the
    causal work by the same zig-zag. Here a buffer of ``seq`` placeholders stands for them.
    """
    if device.type != "cuda":
        raise ConfigError("context_parallel needs CUDA GPUs (it runs SDPA's flash or efficient "
                          "kernel); on the CPU use ring_attention")
    from torch.distributed.tensor.experimental import context_parallel

    marker = torch.empty(1, seq, device=device)
    with context_parallel(mesh, buffers=[marker], buffer_seq_dims=[1],
                          no_restore_buffers={marker}):
        yield


def split_sequence(model: GPT, zigzag: bool = True, group=None) -> GPT:
    """Context parallelism on the GPT, in place: each block's attention becomes ring attention.

    Feed each rank its tokens and their places, ``model(shard(idx, ..., dim=1),
    positions(...))``. Every parameter stays whole on every rank, and its gradient is summed
    over the ranks, as in data parallelism.
    """
    attend = functools.partial(ring_attention, zigzag=zigzag, group=group)
    for block in model.blocks:
        block.attn.attend = attend
    return model


def attention_bytes_per_rank(batch: int, heads: int, seq: int, head_dim: int, world: int,
                             value_bytes: int = 4) -> int:
    """What ring attention keeps for backward on each rank: its S / N rows of q, k, v and the
    output (batch x heads x S/N x head_dim values each) and one fp32 log-sum-exp per row.

    One process (N = 1) with a fused kernel keeps the same for all S rows. In forward a rank
    also holds, for a moment, the block in flight and one block of scores per chunk pair.
    """
    rows = batch * heads * seq // world
    return rows * (4 * head_dim * value_bytes + 4)
