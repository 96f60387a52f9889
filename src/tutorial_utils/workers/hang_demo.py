"""Run under torchrun: a collective that one rank never joins fails after the timeout.

    torchrun --standalone --nproc_per_node=2 -m tutorial_utils.workers.hang_demo --timeout 10

All ranks first complete one all-reduce, as a job does in its first steps. Then rank 0 enters
a second all-reduce that the last rank, standing for a rank stuck elsewhere (a data loader, a
different branch of an ``if``), never joins. Without a timeout rank 0 would wait forever; with
the process group's timeout the job fails, and torchrun stops it:

- gloo: the all-reduce call itself raises once the timeout has passed;
- NCCL: the call returns at once (the GPU waits, not the host), the host blocks when it reads
  the result, and NCCL's watchdog thread detects the timeout; it then waits four times
  ``TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC`` (a minute by default) for the ranks to dump their
  flight records before it aborts the collective and the process (measured on 2 H200s with
  torch 2.11: a 10 s timeout ended the job after 83 s).

The first all-reduce matters with NCCL: it connects the ranks inside that first call, which
needs every rank, so a rank missing from it leaves the others blocked there before any timeout
clock starts (seen on 2 H200s with torch 2.11).
``TORCH_DISTRIBUTED_DEBUG=DETAIL`` adds checks that report mismatched collectives (different
operations or shapes on different ranks) by name.

``--flight-record DIR`` (with ``TORCH_FR_BUFFER_SIZE`` set, which turns PyTorch's flight
recorder on) has each rank write its record of collectives to ``DIR/rank_<r>`` when it stops
communicating: the last rank before it goes elsewhere, the others when their collective times
out. NCCL's watchdog can write them itself on a timeout (``TORCH_NCCL_DUMP_ON_TIMEOUT``); gloo
keeps the same record but has no watchdog to write it. :func:`tutorial_utils.debugging.
never_joined` reads the records back.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from ..config import Config, check, opt, parse_or_exit
from ..debugging import write_flight_record
from ..parallel.distributed import distributed


@dataclass
class HangConfig(Config):
    """Run under torchrun: a collective that one rank never joins fails after the timeout."""

    timeout: float = opt(10.0, "the process group's timeout, s")
    device: Literal["auto", "cpu", "cuda"] = opt("auto", "cuda needs one GPU per process")
    flight_record: str | None = opt(None, "folder for each rank's flight record (set "
                                    "TORCH_FR_BUFFER_SIZE too)")

    def __post_init__(self) -> None:
        check((self.timeout > 0, f"--timeout must be > 0, got {self.timeout}"))


def main(argv: list[str] | None = None) -> None:
    args = parse_or_exit(HangConfig, argv, __spec__.name)
    with distributed(args.device, timeout_s=args.timeout) as ctx:
        t = torch.ones(1, device=ctx.device)
        dist.all_reduce(t)
        print(f"rank {ctx.rank}: first all-reduce done ({t.item():.0f} ranks)", flush=True)
        if ctx.rank == ctx.world_size - 1:
            print(f"rank {ctx.rank}: busy elsewhere, never joining the next one", flush=True)
            if args.flight_record:
                write_flight_record(args.flight_record, ctx.rank)
            time.sleep(args.timeout * 10)
            return
        print(f"rank {ctx.rank}: entering all-reduce (timeout {args.timeout:.0f} s)", flush=True)
        try:
            dist.all_reduce(t)
            t.item()  # the host needs the result: NCCL makes it wait here
        except RuntimeError as err:  # DistBackendError is a RuntimeError too
            print(f"{type(err).__name__}: {str(err).splitlines()[0]}", flush=True)
            if args.flight_record:
                write_flight_record(args.flight_record, ctx.rank)
            sys.exit(1)


if __name__ == "__main__":
    main()
