"""Chapter 8's expert parallelism on CPU processes: equal to one process, and what it moves.

:func:`check_rows` runs :mod:`tutorial_utils.workers.ep_check` on N gloo processes (N GPUs with
``device="cuda"``); :func:`dispatch_table` sets its rows out: the tokens each expert got, the
load imbalance (busiest expert over the mean) and the bytes each rank sent by all-to-all in
forward, measured beside the prediction for a router that spreads the tokens evenly.
"""

from __future__ import annotations

from ..launch import run_worker
from ..workers.ep_check import EPCheckConfig, EPRow
from . import records
from .report import Column, table

WORKER = "tutorial_utils.workers.ep_check"


def check_rows(nproc: int, cfg: EPCheckConfig | None = None) -> list[EPRow]:
    """One row per (experts, top_k) of ``cfg`` (default: 4 experts, top-2), on ``nproc``."""
    rows = run_worker(WORKER, cfg or EPCheckConfig(device="cpu"), nproc=nproc, timeout_s=300)
    return [records.from_row(EPRow, r) for r in rows]


def dispatch_table(rows: list[EPRow]) -> str:
    """One line per run: the dispatch, and the largest difference from one process."""
    lines = [{**vars(r), "per_expert": "  " + " ".join(map(str, r.per_expert)),
              "kib": max(r.bytes_out) / 2**10, "kib_even": r.predicted_bytes / 2**10,
              "worst": max(r.loss_diff, r.out_diff, r.router_grad_diff, r.expert_grad_diff,
                           r.other_grad_diff)} for r in rows]
    width = max([len(r["per_expert"]) for r in lines] + [19]) + 2
    return table(lines, (
        Column("world", "ranks", width=6), Column("experts", "experts", width=8),
        Column("top_k", "top-k", width=6), Column("tokens", "all tokens", width=11),
        Column("per_expert", "  tokens per expert", width=width, left=True),
        Column("imbalance", "max/mean", ".2f", 9), Column("kib", "KiB sent/rank", ".1f", 14),
        Column("kib_even", "if even", ".1f", 9), Column("worst", "largest diff", ".1e", 14)))
