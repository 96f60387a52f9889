"""Under torchrun (2 processes, gloo): every rank resumes with its own RNG state.

    torchrun --nproc_per_node=2 tests/workers/rng_states.py <checkpoint path>

Each rank seeds itself differently and draws; rank 0 saves every rank's state, gathered
before the draws; each rank then loads the checkpoint and must draw again exactly what it drew,
not what rank 0 drew. Prints "rng_states ok".
"""

import random
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tutorial_utils.checkpoint import (
    check_world_size,
    gather_rng_states,
    load_checkpoint,
    rng_state_for_rank,
    save_checkpoint,
    set_rng_state,
)
from tutorial_utils.parallel.distributed import distributed

path = Path(sys.argv[1])
with distributed("cpu") as ctx:
    torch.manual_seed(10 + ctx.rank)
    random.seed(10 + ctx.rank)
    saved = gather_rng_states(ctx)  # a collective: every rank calls it
    drawn = (torch.rand(4), random.random())
    assert (saved is None) == (ctx.rank != 0), saved
    if ctx.is_main:
        assert len(saved) == ctx.world_size
        save_checkpoint(path, {"rng": saved, "world_size": ctx.world_size})
    ctx.barrier()
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, drawn)
    assert not torch.equal(everyone[0][0], everyone[1][0]), "the ranks drew alike"
    torch.manual_seed(99)
    random.seed(99)
    state = load_checkpoint(path, {}, required=("rng", "world_size"))
    check_world_size(state, ctx.world_size, path)
    set_rng_state(rng_state_for_rank(state["rng"], ctx.rank), ctx.device)
    assert torch.equal(torch.rand(4), drawn[0]), f"rank {ctx.rank} got another rank's state"
    assert random.random() == drawn[1]
    if ctx.is_main:
        print("rng_states ok", flush=True)
