"""A whole training step recorded once as a CUDA graph and replayed: one launch per step.

``torch.compile(mode="reduce-overhead")`` graphs the network's forward and backward, but the
rest of a step still runs from Python: the optimizer and, under DDP, the per-parameter hooks
that copy gradients into buckets, the all-reduces and the buffer broadcast. At a small batch
that host work outlasts the GPU's. :class:`StepGraph` records everything between two steps,
all-reduces included (NCCL collectives can be captured), so the host only launches the graph.

The rules it follows (see "CUDA Graphs" in PyTorch's CUDA semantics notes):

- the step reads its batch from tensors that never move: copy each new batch into them;
- warm-up steps run on a side stream before capture (cuDNN autotuning, lazy optimizer state,
  DDP's bucket rebuild after its first iteration and its sampled timing statistics);
- DDP is built on that same stream (:meth:`StepGraph.stream`);
- gradients are ``None`` when capture starts, so backward allocates them from the graph's
  memory and every replay writes fresh gradients there (the step may set them to ``None``
  itself first; that is host work and records nothing);
- autocast's weight-cast cache is off inside the step (``cache_enabled=False``): a cached
  cast would be freed when the autocast region ends, while the graph still reads it;
- the graph is released before the process group is destroyed (use the ``StepGraph`` as a
  context manager): on 2 H200s, processes that destroyed it while their graphs of captured
  all-reduces were still alive hung on exit.

The warm-up steps train on whatever batch the static tensors hold, so :meth:`StepGraph.capture`
puts the weights, buffers and optimizer state back as they were before them: the first replay is
the first training step, exactly as without the graph. The optimizer may run inside the graph
or after each replay, reading the gradients the graph left. On a CPU, or with ``enabled=False``,
nothing is captured and each step clears the gradients and then runs as written.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
from torch import nn

# DDP samples timing statistics (with host synchronisation) during its first 10 iterations;
# none of those may fall inside the capture.
DDP_WARMUP_STEPS = 11

T = TypeVar("T")


class StepGraph:
    """Capture ``body`` (forward, backward, and the optimizer step or not) as one CUDA graph.

    ::

        with StepGraph(device) as graph:
            with graph.stream():
                model = DistributedDataParallel(net, device_ids=[device.index])
            step = graph.capture(body, net, optimizer)  # warm-up, record, restore
            for batch in loader:
                static_x.copy_(batch)
                loss = step()  # one graph launch; what body returned, refilled
    """

    def __init__(self, device: torch.device, enabled: bool = True) -> None:
        self.device = torch.device(device)
        self.enabled = enabled and self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self.enabled else None
        self.graph: torch.cuda.CUDAGraph | None = None

    @contextlib.contextmanager
    def stream(self) -> Iterator[None]:
        """Run the block on the capture stream, ordered after the work queued before it."""
        if self._stream is None:
            yield
            return
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            yield
        current.wait_stream(self._stream)

    def __enter__(self) -> StepGraph:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def release(self) -> None:
        """Free the graph and its memory (before destroying the process group it uses)."""
        if self.graph is not None:
            self.graph.reset()
            self.graph = None

    def capture(self, body: Callable[[], T], model: nn.Module,
                optimizer: torch.optim.Optimizer,
                warmup: int = DDP_WARMUP_STEPS) -> Callable[[], T]:
        """Warm ``body`` up, record it, and return the function that replays it.

        ``model`` and ``optimizer`` are what ``body`` trains: their state is restored after
        the warm-up, in place, so the graph keeps reading and writing the same memory. The
        replay returns what ``body`` returned while it was recorded: tensors the graph fills
        again on every replay (read them before the next one).
        """
        if warmup < 1:
            raise ValueError(f"capture needs at least one warm-up step, got warmup={warmup}")

        def eager_step() -> T:
            optimizer.zero_grad(set_to_none=True)
            return body()

        if not self.enabled:
            return eager_step
        before = {id(t): t.detach().clone() for t in _state_tensors(model, optimizer)}
        with self.stream():
            for _ in range(warmup):
                eager_step()
        optimizer.zero_grad(set_to_none=True)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=self._stream):
            outputs = body()
        with torch.no_grad():
            for t in _state_tensors(model, optimizer):
                if id(t) in before:
                    t.copy_(before[id(t)])
                else:  # state the warm-up created (momentum, say) starts from zero, as if new
                    t.zero_()
        graph = self.graph

        def replay() -> T:
            graph.replay()
            return outputs

        return replay


def _state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor a training step changes: weights, buffers, optimizer state."""
    tensors = list(model.parameters()) + list(model.buffers())
    for state in optimizer.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors
