"""Run under torchrun: two ranks that call different collectives, the bug DETAIL debugging names.

    TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun --standalone --nproc_per_node=2 \\
        -m tutorial_utils.workers.mismatch_demo --mismatch shape

``--mismatch shape``: every rank all-reduces, the last rank a tensor twice as long (a batch
that was not divided evenly, say). ``--mismatch op``: the last rank broadcasts while the others
all-reduce (a code path only one rank takes). Without ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` the
job crashes or hangs until the timeout, with no word on why; with it, the process group checks
each collective's fingerprint (operation, shapes, dtypes) across the ranks before running it,
and raises an error that names both ranks and what each one called.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from ..config import Config, opt, parse_or_exit
from ..parallel.distributed import distributed

_FINGERPRINT = re.compile(r"Rank (\d+) is running collective: CollectiveFingerPrint\("
                          r"SequenceNumber=\d+, OpType=(\w+), TensorShape=\[([^\]]*)\]")


@dataclass
class MismatchConfig(Config):
    """Run under torchrun: ranks that call different collectives (set TORCH_DISTRIBUTED_DEBUG)."""

    mismatch: Literal["shape", "op"] = opt("shape", "what the last rank does differently")
    timeout: float = opt(20.0, "seconds a collective waits before the process group gives up")


def mismatched_collective(kind: str) -> None:
    last = dist.get_rank() == dist.get_world_size() - 1
    t = torch.ones(8 if last and kind == "shape" else 4)
    if last and kind == "op":
        dist.broadcast(t, src=0)
    else:
        dist.all_reduce(t)


def summary(line: str) -> str | None:
    """One line from DETAIL's mismatch error: which rank ran which collective on which shape."""
    found = _FINGERPRINT.findall(line)  # this rank's fingerprint, then the other rank's
    if "Detected mismatch between collectives" not in line or len(found) < 2:
        return None
    (r0, op0, s0), (r1, op1, s1) = found[:2]
    return f"rank {r0} called {op0} on shape [{s0}], rank {r1} {op1} on shape [{s1}]"


def main(argv: list[str] | None = None) -> None:
    cfg = parse_or_exit(MismatchConfig, argv, __spec__.name)
    with distributed("cpu", timeout_s=cfg.timeout):
        mismatched_collective(cfg.mismatch)


if __name__ == "__main__":
    main()
