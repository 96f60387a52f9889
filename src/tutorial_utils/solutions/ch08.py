"""Solutions to the exercises of chapter 8, "More dimensions"."""

from __future__ import annotations

from ..parallel.context import attention_bytes_per_rank
from ..parallel.experts import predicted_bytes
from ..parallel.gpt_pipeline import bubble_fraction


def micro_batches_for_bubble(stages: int, bubble: float) -> int:
    """Exercise 1: the fewest micro-batches m for which 1F1B's bubble (p-1)/(m+p-1) on
    ``stages`` processes is below ``bubble``: m > (p-1)(1-b)/b."""
    m = 1
    while bubble_fraction("1f1b", stages, m) >= bubble:
        m += 1
    return m


def ring_bytes(seq: int, heads: int, head_dim: int, ranks: int) -> tuple[int, int]:
    """Exercise 2: bytes ring attention keeps for backward per rank and block (bf16 q, k, v
    and output, an fp32 log-sum-exp per query), and what one GPU keeps for the whole sequence."""
    return (attention_bytes_per_rank(1, heads, seq, head_dim, ranks, value_bytes=2),
            attention_bytes_per_rank(1, heads, seq, head_dim, 1, value_bytes=2))


def all_to_all_bytes(tokens: int, dim: int, top_k: int, ranks: int) -> float:
    """Exercise 3: bytes a rank sends to the others per MoE block in forward (bf16), the rows
    out and the results back, for a router that spreads the tokens evenly."""
    return predicted_bytes(tokens, dim, top_k, ranks, value_bytes=2)
