"""Run under torchrun: a collective that one rank never joins fails after the timeout.

    torchrun --standalone --nproc_per_node=2 -m tutorial_utils.parallel.hang_demo --timeout 10

Rank 0 enters an all-reduce; the last rank, standing for a rank stuck elsewhere (a data
loader, a different branch of an ``if``), never does. Without a timeout rank 0 would wait
forever; with the process group's timeout it raises an error naming the operation, and
torchrun stops the job. That is what happens with gloo. With NCCL on 2 H200s (torch 2.11)
the timeout never fired: this all-reduce is the first collective, NCCL connects the ranks inside
that call, and rank 0 stays blocked there before any timeout clock starts, with or without
``TORCH_NCCL_BLOCKING_WAIT=1`` (``scripts/probes/nccl_hang.py``); the launcher's timeout ends
the job. ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` adds checks that report mismatched collectives
(different operations or shapes on different ranks) by name.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist

from .distributed import distributed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=10.0, help="process-group timeout, s")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    args = parser.parse_args(argv)
    with distributed(args.device, timeout_s=args.timeout) as ctx:
        if ctx.rank == ctx.world_size - 1:
            print(f"rank {ctx.rank}: busy elsewhere, never joining the all-reduce", flush=True)
            time.sleep(args.timeout * 10)
            return
        print(f"rank {ctx.rank}: entering all-reduce (timeout {args.timeout:.0f} s)", flush=True)
        t = torch.ones(1, device=ctx.device)
        try:
            dist.all_reduce(t)  # gloo raises here once the timeout has passed
        except RuntimeError as err:  # DistBackendError is a RuntimeError too
            print(f"{type(err).__name__}: {str(err).splitlines()[0]}", flush=True)
            sys.exit(1)


if __name__ == "__main__":
    main()
