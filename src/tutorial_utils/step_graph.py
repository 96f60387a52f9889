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

Collectives replayed from a graph are not watched by NCCL's watchdog (work captured while the
stream records is not enqueued for it): chapter 6's timeout does not cover ``--step-graph``.
:class:`StepGraph` watches its replays instead and ends the process when one is late.

The warm-up steps train on whatever batch the static tensors hold, so :meth:`StepGraph.capture`
puts the weights, buffers and optimizer state back: the first replay is the first training
step, exactly as without the graph. The optimizer may run inside the graph or after each
replay, on the gradients the graph left. On a CPU, or with ``enabled=False``, nothing is
captured and each step clears the gradients and then runs as written.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

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

    - No ``optimizer.zero_grad()`` (``set_to_none=True``) between replays, or the graph writes
      gradients no parameter holds (``RuntimeError``); each replay overwrites them anyway.
    - If ``body`` steps the optimizer, a float lr is baked into the kernels, out of the
      scheduler's reach: use a tensor lr the kernels read on the parameters' device,
      ``SGD(..., lr=torch.tensor(0.1, device=dev), fused=True)`` (``capturable=True`` for
      Adam and others). Otherwise ``ValueError``, on a CPU too (any tensor lr will do there).
    - NCCL's watchdog does not see the graph's collectives: when a replay has not finished
      within ``timeout_s`` (the process group's 600 s), one line goes to stderr and the
      process exits (``os._exit(1)``), so torchrun ends the job.
    """

    def __init__(self, device: torch.device, enabled: bool = True, timeout_s: float = 600.0):
        self.device = torch.device(device)
        self.enabled = enabled and self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self.enabled else None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.watchdog = ReplayWatchdog(timeout_s, lambda: _end_process(timeout_s))

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
        self.watchdog.stop()
        if self.graph is not None:
            self.graph.reset()
            self.graph = None

    def capture(self, body: Callable[[], T], model: nn.Module,
                optimizer: torch.optim.Optimizer,
                warmup: int = DDP_WARMUP_STEPS) -> Callable[[], T]:
        """Warm ``body`` up, record it, and return the function that replays it.

        ``model`` and ``optimizer`` are what ``body`` trains: their state is restored after
        the warm-up, in place, so the graph keeps using the same memory. The replay returns
        what ``body`` returned when recorded: tensors each replay refills (read them first).
        """
        if warmup < 1:
            raise ValueError(f"capture needs at least one warm-up step, got warmup={warmup}")

        def eager_step() -> T:
            optimizer.zero_grad(set_to_none=True)
            # Eager steps (the warm-up's too) check the lr: before capture, and on a CPU alike.
            hook = optimizer.register_step_pre_hook(lambda o, *_: _check_lr(o, self.enabled))
            try:
                return body()
            finally:
                hook.remove()

        if not self.enabled:
            return eager_step
        before = {id(t): t.detach().clone() for t in _state_tensors(model, optimizer)}
        with self.stream():
            for _ in range(warmup):
                eager_step()
        optimizer.zero_grad(set_to_none=True)
        self.graph = graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=self._stream):
            outputs = body()
        with torch.no_grad():
            for t in _state_tensors(model, optimizer):
                if id(t) in before:
                    t.copy_(before[id(t)])
                else:  # state the warm-up created (momentum, say) starts from zero, as if new
                    t.zero_()
        params = list(model.parameters())
        grads = [p.grad for p in params]  # what the graph writes, from its own memory
        # Query events on this GPU, not GPU 0 (a context costs memory); the stream's has an index.
        self.watchdog.start(setup=lambda: torch.cuda.set_device(self._stream.device))

        def replay() -> T:
            _check_grads_unchanged(params, grads)
            graph.replay()
            self.watchdog.watch(torch.cuda.current_stream(self.device).record_event())
            return outputs

        return replay


class ReplayWatchdog:
    """Call ``on_timeout`` when a watched event (one per replay) is not done in ``timeout_s``."""

    def __init__(self, timeout_s: float, on_timeout: Callable[[], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s, self.on_timeout, self.clock = timeout_s, on_timeout, clock
        # (event, when queued): the host appends, the thread pops; deque makes both atomic.
        self._pending: deque[tuple[Any, float]] = deque()
        self._progress = clock()
        self._stop, self.thread = threading.Event(), None

    def watch(self, event: Any) -> None:
        self._pending.append((event, self.clock()))

    def check(self) -> bool:
        """Forget completed events; past the deadline, call ``on_timeout`` and say so."""
        now = self.clock()
        while self._pending and self._pending[0][0].query():
            self._pending.popleft()
            self._progress = now
        # A replay queued behind others can't start before they end: time it from then.
        start = max(self._pending[0][1], self._progress) if self._pending else now
        if late := now - start > self.timeout_s:
            self.on_timeout()
        return late

    def start(self, setup: Callable[[], object] = lambda: None) -> None:
        """Check in a daemon thread (one that never keeps a finished process alive)."""
        if self.thread is not None:
            return
        stop = self._stop = threading.Event()

        def run() -> None:
            setup()
            while not stop.wait(min(1.0, self.timeout_s / 10)) and not self.check():
                pass

        self.thread = threading.Thread(target=run, name="step-graph-watchdog", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self.thread is not None:
            self.thread.join()
            self.thread = None


def _end_process(timeout_s: float) -> None:
    # os._exit: the main thread may wait in CUDA for ever. The launcher's summary shows the line.
    print(f"TimeoutError: rank {os.environ.get('RANK', '0')}: a replayed CUDA graph did not "
          f"finish within {timeout_s:g} s (did a peer stop replaying?); StepGraph's watchdog "
          "ends the process", file=sys.stderr, flush=True)
    os._exit(1)


def _check_grads_unchanged(params: list[torch.Tensor], captured: list[torch.Tensor | None]):
    """Raise unless every parameter's ``.grad`` is still the tensor the graph writes."""
    for p, g in zip(params, captured, strict=True):
        if p.grad is not g:
            raise RuntimeError(
                "a .grad is no longer the tensor the CUDA graph writes, so the replays would "
                "train on nothing: don't call zero_grad(set_to_none=True) (the default) between "
                "replays; call zero_grad(set_to_none=False) or nothing (a replay overwrites them)")


def _check_lr(optimizer: torch.optim.Optimizer, capturing: bool) -> None:
    """Refuse a learning rate that a recorded optimizer step would freeze."""
    for group in optimizer.param_groups:
        lr = group["lr"]
        # foreach SGD bakes a tensor lr too; fused or capturable ones read it (others: trusted)
        flags = [bool(group[k]) for k in ("fused", "capturable") if k in group]
        ok = isinstance(lr, torch.Tensor) and (not capturing or (
            lr.device == group["params"][0].device and (any(flags) or not flags)))
        if not ok:
            raise ValueError(
                f"body steps the optimizer with lr={lr!r}, which a CUDA graph bakes into its "
                "kernels (a scheduler would never reach it): use SGD(..., lr=torch.tensor(0.1, "
                "device=device), fused=True), capturable=True for Adam and others, or step the "
                "optimizer outside body, after each replay")


def _state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor a training step changes: weights, buffers, optimizer state."""
    tensors = list(model.parameters()) + list(model.buffers())
    for state in optimizer.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors
