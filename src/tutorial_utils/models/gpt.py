"""A small GPT: a decoder-only transformer (Radford et al., 2019), written to be split.

Each block is pre-norm: ``x + attention(norm(x))``, then ``x + mlp(norm(x))``. Two choices
serve tensor parallelism (chapter 7). The attention has separate ``q``, ``k`` and ``v``
projections, so splitting each one's output features splits whole heads; a fused ``qkv``
projection would hand one rank all the queries. And ``forward`` finds the number of heads
from the tensor it is given (``view(b, t, -1, head_dim)``), so a rank that holds a quarter of
the heads runs the same code. The token embedding and the output layer are not tied, so each
can be split its own way.

Two options serve chapter 8. ``GPTConfig(experts=E, top_k=k)`` replaces each block's MLP by a
mixture of E expert MLPs and a router (:class:`MoE`), which expert parallelism spreads over the
ranks (:mod:`tutorial_utils.parallel.experts`); ``experts=0``, the default, is the dense model,
the same parameters and the same numbers as before the option existed. And the attention calls
``self.attend``, plain causal SDPA, which context parallelism replaces by ring attention
(:mod:`tutorial_utils.parallel.context`), with ``forward(idx, positions)`` giving each rank's
tokens their place in the whole sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256  # bytes
    seq: int = 256  # the longest context
    layers: int = 6
    heads: int = 6
    dim: int = 384
    experts: int = 0  # 0: a dense MLP in each block; E >= 1: a mixture of E expert MLPs
    top_k: int = 2  # how many experts each token goes to (with experts >= 1)

    def __post_init__(self) -> None:
        for holds, message in (*shape_rules(self.dim, self.heads, self.layers, self.seq),
                               *mixture_rules(self.experts, self.top_k)):
            if not holds:
                raise ValueError(message)


def shape_rules(dim: int, heads: int, layers: int, seq: int) -> tuple[tuple[bool, str], ...]:
    """What a GPT's shape must meet, as (holds, message) pairs (``config.check`` takes them)."""
    return ((min(dim, heads, layers, seq) >= 1, "--dim, --heads, --layers and --seq must be >= 1"),
            (dim % max(heads, 1) == 0, f"dim={dim} must be a multiple of heads={heads}"))


def mixture_rules(experts: int, top_k: int) -> tuple[tuple[bool, str], ...]:
    """What a mixture of experts must meet, as (holds, message) pairs; ``experts=0``: none."""
    return ((experts >= 0, f"experts={experts} must be >= 0 (0: a dense MLP)"),
            (experts == 0 or 1 <= top_k <= experts,
             f"top_k={top_k} must be between 1 and experts={experts}: each token goes to "
             "top_k different experts"))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Each position attends to itself and the positions before it."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)
        self.attend = causal_attention  # ring attention under context parallelism

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1: as many heads as this rank's share of the features holds
        q, k, v = (f(x).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for f in (self.q, self.k, self.v))
        y = self.attend(q, k, v)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


def route(logits: torch.Tensor, top_k: int):
    """Top-k routing with softmax gates, and the load-balancing loss.

    ``logits``: (tokens, experts), the router's scores. Each token goes to the ``top_k``
    experts of highest probability ``softmax(logits)``, its output the sum of theirs weighted
    by those probabilities, not renormalised: with ``top_k=1`` the gate is then below 1 and
    the loss's gradient reaches the router through it (Shazeer et al., 2017; Fedus et al.,
    2021). Returns the gates and the chosen experts, each (tokens, top_k), and the auxiliary
    loss ``E * sum_e f_e * p_e`` (Switch Transformer, GShard), where ``f_e`` is the fraction
    of the assignments that went to expert e and ``p_e`` the mean probability the router gave
    it. Only ``p_e`` carries a gradient; the loss is 1 when both are uniform and E when every
    token goes to one expert, so adding it pushes the router to spread the tokens.
    """
    probs = logits.float().softmax(-1)
    gates, chosen = probs.topk(top_k, dim=-1)
    experts = logits.shape[-1]
    share = F.one_hot(chosen, experts).flatten(0, 1).float().mean(0)  # f_e
    balance = experts * (share * probs.mean(0)).sum()
    return gates.to(logits.dtype), chosen, balance


class MoE(nn.Module):
    """A mixture of ``experts`` MLPs: a router sends each token to ``top_k`` of them.

    Every token is computed (no capacity limit drops any): an expert takes however many
    tokens the router gives it. ``balance_loss`` holds the last forward's auxiliary loss.
    """

    def __init__(self, dim: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(MLP(dim) for _ in range(experts))
        self.balance_loss = torch.zeros(())

    def __getstate__(self) -> dict:
        # a copy of the model (deepcopy, pickle) leaves out the last loss and its graph
        return super().__getstate__() | {"balance_loss": torch.zeros(())}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        gates, chosen, self.balance_loss = route(self.router(tokens), self.top_k)
        y = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            # an expert chosen by no token still runs, on no rows: its gradient is then
            # zero rather than missing, on one process as on many
            token, slot = (chosen == e).nonzero(as_tuple=True)
            y = y.index_add(0, token, expert(tokens[token]) * gates[token, slot, None])
        return y.view_as(x)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, experts: int = 0, top_k: int = 2) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = MoE(dim, experts, top_k) if experts else MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Embedding(nn.Module):
    """Token embedding plus a learned position embedding."""

    def __init__(self, vocab: int, seq: int, dim: int) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)

    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        if positions is None:  # the whole sequence; a context-parallel rank passes its own
            positions = torch.arange(idx.shape[1], device=idx.device)
        return self.tokens(idx) + self.positions(positions)


class GPT(nn.Module):
    """Tokens (batch, seq) in, logits (batch, seq, vocab) out; ``positions``: where in the
    whole sequence each of the ``seq`` tokens stands (default: ``0 .. seq-1``).

    ``activation_checkpointing`` keeps only each block's input for backward and recomputes
    the rest of the block there: less memory for about a third more compute.
    """

    def __init__(self, cfg: GPTConfig, activation_checkpointing: bool = False) -> None:
        super().__init__()
        self.cfg, self.activation_checkpointing = cfg, activation_checkpointing
        self.embed = Embedding(cfg.vocab, cfg.seq, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg.dim, cfg.heads, cfg.experts, cfg.top_k)
                                    for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.apply(self._init)
        scale_residuals(self, cfg.layers)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear | nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(idx, positions)
        for block in self.blocks:
            x = (checkpoint(block, x, use_reentrant=False) if self.activation_checkpointing
                 and self.training else block(x))
        return self.head(self.norm(x))

    def balance_loss(self) -> torch.Tensor:
        """The blocks' load-balancing losses of the last forward, summed (0 for a dense GPT);
        add a small multiple of it to the training loss (Switch used 0.01)."""
        # a dense MLP has none; a mixture, whole or spread over ranks, has its last one
        return sum((b.mlp.balance_loss for b in self.blocks if hasattr(b.mlp, "balance_loss")),
                   torch.zeros(()))


def scale_residuals(module: nn.Module, layers: int) -> None:
    """GPT-2's rule, on every block in ``module``: the layers that write into the residual
    stream (attention's ``o``, each MLP's ``proj``, an expert's too) drawn with a standard
    deviation scaled down with depth."""
    for m in module.modules():
        out = m.o if isinstance(m, Attention) else m.proj if isinstance(m, MLP) else None
        if out is not None:
            nn.init.normal_(out.weight, std=0.02 / math.sqrt(2 * layers))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the next byte over every position."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def flops_per_token(cfg: GPTConfig, n_params: int) -> float:
    """Training FLOPs per token: 6 per parameter (forward 2, backward 4) plus attention's
    scores and their weighted sum, 12 * layers * seq * dim (the PaLM paper's count). With
    experts, pass the parameters a token uses (``top_k`` experts' of each block's), not all."""
    return 6 * n_params + 12 * cfg.layers * cfg.seq * cfg.dim
