"""The DDP step of :mod:`.workload` in N processes: the launching side of chapter 4's and 5b's
timings.

:func:`time_ddp` starts :mod:`~tutorial_utils.bench.workers.step_timing` under torchrun with a
:class:`~tutorial_utils.bench.workers.step_timing.StepTimingConfig` and reads back the typed
row its rank 0 wrote; :func:`ddp_step` builds that configuration from a workload; :func:`trace`
does the same with a profiler trace of a few steps (the timeline of chapter 5b).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..launch import run_worker
from .workers.step_timing import StepTiming, StepTimingConfig
from .workload import Workload

STEP_TIMING = "tutorial_utils.bench.workers.step_timing"


def time_ddp(cfg: StepTimingConfig, n: int, timeout_s: float = 900) -> StepTiming:
    """What :mod:`~tutorial_utils.bench.workers.step_timing` measured with ``cfg`` in ``n``
    processes."""
    return run_worker(STEP_TIMING, cfg, nproc=n, timeout_s=timeout_s, row_type=StepTiming)[0]


def ddp_step(size: Workload, device: str, compile_mode: str = "none", capture: bool = False,
             trace: Path | None = None) -> StepTimingConfig:
    """The DDP step of ``size`` on ``device``; ``capture`` records it whole as one CUDA graph,
    with fused SGD as in ``train.py``."""
    shared = {f.name: getattr(size, f.name) for f in dataclasses.fields(Workload)}
    return StepTimingConfig(**shared, device=device, compile=compile_mode,
                            capture=capture, optimizer="fused" if capture else "foreach",
                            trace=trace)


def trace(size: Workload, n: int, device: str, graphed: bool, path: Path) -> StepTiming:
    """Time and profile one DDP configuration in ``n`` processes (a step graph when
    ``graphed``); rank 0's Chrome trace goes to ``path``."""
    return time_ddp(ddp_step(size, device, "default" if graphed else "none", capture=graphed,
                             trace=path), n)
