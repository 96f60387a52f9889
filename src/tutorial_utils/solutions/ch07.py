"""Solutions to the exercises of chapter 7, "A transformer: tensor parallelism"."""

from __future__ import annotations

from ..parallel.tensor import tp_bytes_per_step


def tp_all_reduce_ms(tokens: int, dim: int, layers: int, tp: int, bus_gbps: float) -> float:
    """Exercise 1: milliseconds per step that TP's all-reduces take (bf16 activations, no
    overlap with compute) at a bus bandwidth of ``bus_gbps`` GB/s."""
    return tp_bytes_per_step(tokens, dim, layers, tp) / (bus_gbps * 1e9) * 1e3


def break_even_dim(tp: int, flops_per_s: float, bus_gbps: float) -> float:
    """Exercise 2: the hidden size at which TP's communication takes as long as its compute.

    comm / compute = 2 (N-1)/N * 8 dim / B  over  72 dim^2 / (N F) = 2 (N-1) F / (9 dim B),
    which is 1 at dim = 2 (N-1) F / (9 B).
    """
    return 2 * (tp - 1) * flops_per_s / (9 * bus_gbps * 1e9)


def params_per_rank_2d(n_params: int, dp: int, tp: int) -> float:
    """Exercise 3: parameters one rank holds on a dp x tp mesh (TP splits the blocks' weights
    N ways, FSDP2 shards what is left over dp), for a model whose weights all split."""
    return n_params / (dp * tp)
