"""Where the memory of a training step goes: parameters, gradients, optimizer state, activations.

:func:`breakdown` counts each part in bytes as the book trains (bf16 autocast, channels_last,
SGD with Nesterov momentum) and, on a GPU, measures the step's peak. :func:`checkpointed`
recomputes the residual blocks' activations in backward instead of keeping them
(:mod:`tutorial_utils.bench.memory` measures the trade). :func:`zero_table` is ZeRO's
accounting (Rajbhandari et al., 2020): what sharding over N GPUs removes of the model state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .models.wrn import BasicBlock
from .step import forward_loss, train_step
from .timing import synchronize

PARTS = ("parameters", "gradients", "optimizer", "weight_copies", "activations")


@dataclass(frozen=True)
class Breakdown:
    """Bytes held during one training step of ``model`` on ``batch`` images."""

    model: str
    batch: int
    parameters: int  # with the buffers (BatchNorm's running statistics)
    gradients: int
    optimizer: int  # SGD's momentum: exists only after the first step
    weight_copies: int  # autocast's bf16 copies of the weights, saved for backward
    activations: int  # every other tensor saved for backward
    peak: int | None = None  # torch.cuda.max_memory_allocated over the step (GPU only)

    @property
    def total(self) -> int:  # the sum of the parts
        return sum(getattr(self, part) for part in PARTS)


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one storage count once)."""
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(seen.values())


def _is_weight_copy(t: torch.Tensor) -> bool:
    """True when ``t`` comes from a parameter through one-input ops only (a cast, a transpose)."""
    fn = t.grad_fn
    while fn is not None and len(fn.next_functions) == 1:
        fn = fn.next_functions[0][0]
        if isinstance(getattr(fn, "variable", None), nn.Parameter):
            return True
    return False


@contextlib.contextmanager
def saved_tensors(exclude=()) -> Iterator[dict[str, dict[int, int]]]:
    """Count what autograd saves for backward inside the ``with`` block, each storage once.

    A pack hook sees every tensor an operation keeps for its backward, on any device.
    Tensors sharing a storage (a ReLU's output that the next convolution also saves) count
    once, the storages in ``exclude`` (the parameters) not at all. Yields
    ``{"activations": {ptr: bytes}, "weight_copies": {ptr: bytes}}``.
    """
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    found: dict[str, dict[int, int]] = {"activations": {}, "weight_copies": {}}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            kind = "weight_copies" if _is_weight_copy(t) else "activations"
            found[kind][storage.data_ptr()] = storage.nbytes()
        return t  # the tensor itself: it lives exactly as long as it would without the hook

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield found


def breakdown(model: nn.Module, optimizer: torch.optim.Optimizer, batch, *, name: str = "",
              bf16: bool = True) -> Breakdown:
    """Run two training steps on ``batch = (x, y)`` and account for the bytes of the second.

    The first step creates the optimizer's state (and lets cuDNN pick its algorithms). In the
    second, :func:`saved_tensors` counts what forward keeps for backward, and on a GPU
    the peak of the whole step (forward, backward, update) is read from the allocator. Besides
    the parts, that peak holds everything else alive at its moment: the batch, the logits and
    loss, cuDNN's workspaces, the gradients flowing backward and other temporaries of backward,
    the allocator's rounding of each block to 512 bytes, and any other tensor of the process,
    so measure with nothing else on the GPU. The parts need not all be alive at once either:
    backward frees a layer's activations as it creates that layer's gradients.
    """
    x, y = batch
    cuda = x.device.type == "cuda"
    train_step(model, optimizer, x, y, "bf16" if bf16 else "fp32")
    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values()
             if torch.is_tensor(v) and v.device == x.device]  # Adam's step counts stay on the CPU
    if cuda:
        synchronize(x.device)
        torch.cuda.reset_peak_memory_stats(x.device)
    with saved_tensors(exclude=params + list(model.buffers())) as saved:
        _, loss = forward_loss(model, x, y, "bf16" if bf16 else "fp32")
    loss.backward()
    grads = storage_bytes(p.grad for p in params if p.grad is not None)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated(x.device) if cuda else None
    return Breakdown(name, len(x), storage_bytes([*params, *model.buffers()]), grads,
                     storage_bytes(state), sum(saved["weight_copies"].values()),
                     sum(saved["activations"].values()), peak)


class Checkpointed(nn.Module):
    """A run of residual blocks whose activations are recomputed in backward, not kept."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Forward keeps only x. Backward runs the blocks again (autocast and the RNG state as
        # in forward) and then their backward: one segment's activations exist at a time.
        return checkpoint(self.blocks, x, use_reentrant=False)


def checkpointed(model: nn.Sequential, segment: int = 1, wrapper=Checkpointed) -> nn.Sequential:
    """The same network, its parameters shared, with each ``segment`` blocks checkpointed.

    The recomputation runs BatchNorm in training mode once more, so its running statistics
    are updated twice per step; the gradients are those of the plain network.
    """
    layers = list(model)
    blocks = [i for i, layer in enumerate(layers) if isinstance(layer, BasicBlock)]
    first, last = blocks[0], blocks[-1] + 1
    runs = [wrapper(layers[i:min(i + segment, last)]) for i in range(first, last, segment)]
    return nn.Sequential(*layers[:first], *runs, *layers[last:])


# Bytes per parameter of (parameters, gradients, optimizer state). "fp32": FP32 weights and
# gradients, bf16 only inside autocast, as this book trains. "mixed": the ZeRO paper's
# recipe, 16-bit weights and gradients plus an FP32 master copy of the weights in the state.
BYTES_PER_PARAM = {
    ("sgd", "fp32"): (4, 4, 4),  # momentum
    ("adam", "fp32"): (4, 4, 8),  # two moments
    ("sgd", "mixed"): (2, 2, 8),  # master weights, momentum
    ("adam", "mixed"): (2, 2, 12),  # master weights, two moments: the paper's K = 12
}
STAGES = ("replicated", "ZeRO-1", "ZeRO-2", "ZeRO-3")  # ZeRO-k shards the last k parts


def bytes_per_param(optimizer: str, precision: str, stage: str, world_size: int) -> float:
    """Bytes per parameter on each of ``world_size`` ranks (ZeRO, Rajbhandari et al. 2020)."""
    parts = BYTES_PER_PARAM[(optimizer, precision)]
    sharded = STAGES.index(stage)  # 0: none; 1: optimizer state; 2: + gradients; 3: + weights
    return sum(b / world_size if i >= 3 - sharded else b for i, b in enumerate(parts))


def zero_table(n_params: int, world_size: int, precision: str = "fp32") -> list[dict]:
    """Bytes per rank of the model state, for SGD with momentum and Adam, per ZeRO stage."""
    return [{"optimizer": opt, "stage": stage, "world_size": world_size,
             "bytes_per_param": (b := bytes_per_param(opt, precision, stage, world_size)),
             "bytes_per_rank": b * n_params}
            for opt in ("sgd", "adam") for stage in STAGES]


# --- What the caching allocator did: a CUDA memory snapshot -----------------------------------


def record_allocations(fn, steps: int = 2, max_entries: int = 200_000) -> dict:
    """Run ``fn()`` ``steps`` times with the CUDA allocator's history on; return its snapshot.

    ``torch.cuda.memory._record_memory_history`` logs every allocation and free (and where in
    Python it came from); ``_snapshot()`` returns that log with the allocator's segments, the
    blocks of memory it has reserved from the driver (PyTorch's "Understanding CUDA Memory
    Usage" guide). ``torch.cuda.memory._dump_snapshot(path)`` writes the same as a file that
    https://pytorch.org/memory_viz draws. The leading underscore: the API may still change.
    """
    torch.cuda.memory._record_memory_history(max_entries=max_entries)
    try:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
        return torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def allocation_timeline(snapshot: dict, device: int = 0) -> list[tuple[int, int]]:
    """(allocated, reserved) bytes after each event of ``device``'s trace, from zero.

    The trace starts when recording did: memory allocated before it counts from the segments
    the snapshot lists, not from the trace, so the curves are what the recorded steps added.
    """
    allocated = reserved = 0
    out = []
    for event in snapshot["device_traces"][device]:
        size, action = event["size"], event["action"]
        allocated += {"alloc": size, "free_completed": -size}.get(action, 0)
        reserved += {"segment_alloc": size, "segment_free": -size}.get(action, 0)
        out.append((allocated, reserved))
    return out


def fragmentation(snapshot: dict) -> dict[str, int]:
    """Reserved against allocated bytes now, and the largest free block inside the segments.

    Free memory inside reserved segments serves a new tensor only if one free block is large
    enough: when the largest is much smaller than the total free, the memory is fragmented.
    """
    blocks = [b for s in snapshot["segments"] for b in s["blocks"]]
    free = [b["size"] for b in blocks if b["state"] == "inactive"]
    return {"reserved": sum(s["total_size"] for s in snapshot["segments"]),
            "allocated": sum(b["size"] for b in blocks if b["state"] == "active_allocated"),
            "free": sum(free), "largest_free": max(free, default=0)}
