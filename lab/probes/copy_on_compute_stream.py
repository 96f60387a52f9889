"""Probe helper: step_timing with GradBuckets' copy into its row back on the compute stream.

    torchrun --standalone --nproc_per_node=2 scripts/probes/copy_on_compute_stream.py ARGS

The same as ``python -m lab.step_timing ARGS``, except that the copy-engine
transport gathers each bucket into this process's row on the compute stream, before handing
over to its own stream (GradBuckets before d1593f4), for an A/B in one invocation.
"""

import torch
from lab.step_timing import main

from tutorial_utils.parallel import grad_buckets

side_stream_start = grad_buckets._PeerCopies.start
gather = grad_buckets._gather


def start_after_copying_here(self, i, wire_views, grads):
    gather(wire_views, grads)  # on the compute stream, between backward kernels
    grad_buckets._gather = lambda *_: None  # the rest as usual, with nothing left to copy
    try:
        side_stream_start(self, i, wire_views, grads)
    finally:
        grad_buckets._gather = gather


grad_buckets._PeerCopies.start = start_after_copying_here

if __name__ == "__main__":
    assert torch.cuda.is_available(), "this A/B compares CUDA streams"
    main()
