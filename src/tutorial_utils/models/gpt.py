"""A small GPT: a decoder-only transformer (Radford et al., 2019), written to be split.

Each block is pre-norm: ``x + attention(norm(x))``, then ``x + mlp(norm(x))``. Two choices
serve tensor parallelism (chapter 7). The attention has separate ``q``, ``k`` and ``v``
projections, so splitting each one's output features splits whole heads; a fused ``qkv``
projection would hand one rank all the queries. And ``forward`` finds the number of heads
from the tensor it is given (``view(b, t, -1, head_dim)``), so a rank that holds a quarter of
the heads runs the same code. The token embedding and the output layer are not tied, so each
can be split its own way.
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

    def __post_init__(self) -> None:
        for holds, message in shape_rules(self.dim, self.heads, self.layers, self.seq):
            if not holds:
                raise ValueError(message)


def shape_rules(dim: int, heads: int, layers: int, seq: int) -> tuple[tuple[bool, str], ...]:
    """What a GPT's shape must meet, as (holds, message) pairs (``config.check`` takes them)."""
    return ((min(dim, heads, layers, seq) >= 1, "--dim, --heads, --layers and --seq must be >= 1"),
            (dim % max(heads, 1) == 0, f"dim={dim} must be a multiple of heads={heads}"))


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1: as many heads as this rank's share of the features holds
        q, k, v = (f(x).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.norm2, self.mlp = nn.LayerNorm(dim), MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Embedding(nn.Module):
    """Token embedding plus a learned position embedding."""

    def __init__(self, vocab: int, seq: int, dim: int) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))


class GPT(nn.Module):
    """Tokens (batch, seq) in, logits (batch, seq, vocab) out.

    ``activation_checkpointing`` keeps only each block's input for backward and recomputes
    the rest of the block there: less memory for about a third more compute.
    """

    def __init__(self, cfg: GPTConfig, activation_checkpointing: bool = False) -> None:
        super().__init__()
        self.cfg, self.activation_checkpointing = cfg, activation_checkpointing
        self.embed = Embedding(cfg.vocab, cfg.seq, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg.dim, cfg.heads) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.apply(self._init)
        for block in self.blocks:  # GPT-2: residual branches scaled down with depth
            for out in (block.attn.o, block.mlp.proj):
                nn.init.normal_(out.weight, std=0.02 / math.sqrt(2 * cfg.layers))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear | nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = (checkpoint(block, x, use_reentrant=False) if self.activation_checkpointing
                 and self.training else block(x))
        return self.head(self.norm(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the next byte over every position."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def flops_per_token(cfg: GPTConfig, n_params: int) -> float:
    """Training FLOPs per token: 6 per parameter (forward 2, backward 4) plus attention's
    scores and their weighted sum, 12 * layers * seq * dim (the PaLM paper's count)."""
    return 6 * n_params + 12 * cfg.layers * cfg.seq * cfg.dim
