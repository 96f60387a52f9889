"""The GPT cut into pipeline stages, and the schedules that run them (chapter 8).

:mod:`tutorial_utils.parallel.pipeline` pipelines a CNN with GPipe and 1F1B; this module does the
same for the GPT of chapter 7 with the four schedules of ``torch.distributed.pipelining`` that
matter in practice:

========================  ===================  =============================================
schedule                  stages per process   reference
========================  ===================  =============================================
``gpipe``                 1                    GPipe (Huang et al., 2019)
``1f1b``                  1                    PipeDream-Flush / 1F1B (Narayanan et al., 2019)
``interleaved-1f1b``      v (2 here)           Megatron-LM interleaved (Narayanan et al., 2021)
``zbv``                   2, in a "V"          Zero Bubble, ZB-V (Qi et al., 2024)
========================  ===================  =============================================

The zero-bubble schedule is ZB-V (``ScheduleZBVZeroBubble``), not DualPipeV. Both split each
backward into its input part (``I``, which the previous stage waits for) and its weight part
(``W``, which can wait to fill a bubble), and both lay the stages out in a V, so that process r
holds stages r and 2p-1-r and the middle two share the last process. On CPU
processes torch 2.11 fails both at its first handshake, which sends a message from that process
to itself (gloo cannot; torch 2.14 skips it): :class:`_Stage` skips it on 2.11 too, after which
ZB-V gives one process's loss and gradients on both versions. DualPipeV would add nothing the
chapter can show: it needs at least 2p micro-batches, and it overlaps a forward with a backward
of another micro-batch inside one action, which pays only where sends run beside compute (GPUs
with spare copy engines, NCCL), not in gloo's blocking CPU sends; and ZB-V is the schedule of
the paper whose bubble and memory the chapter predicts (Qi et al., 2024).

Each process builds only its own stages (:func:`build_stage_module`): the GPT is constructed on
the ``meta`` device, which costs no memory, and only the embedding, blocks, final norm and
output layer of this process's stages are allocated and initialised, each unit from its own seed
(:func:`init_unit`), so that :func:`reference_gpt` builds the whole model with the same weights in
one process. The model's own file is not touched: a stage is made of its ``embed``, ``blocks``,
``norm`` and ``head`` attributes.

The predictions the chapter measures against:

- :func:`bubble_fraction`: the idle fraction of each process's step;
- :func:`in_flight`: how many micro-batches of activations a process holds at its peak;
- :class:`ActivationMeter` measures both in-flight micro-batches and bytes, by counting the
  tensors autograd keeps for backward while they are alive.
"""

from __future__ import annotations

import contextlib
import re
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)

from ..config import ConfigError
from ..models.gpt import GPT, GPTConfig, lm_loss, scale_residuals

# name -> (torch's schedule class, stages per process, how stages are dealt to processes)
SCHEDULES = {
    "gpipe": (ScheduleGPipe, 1, "loop"),
    "1f1b": (Schedule1F1B, 1, "loop"),
    "interleaved-1f1b": (ScheduleInterleaved1F1B, 2, "loop"),
    "zbv": (ScheduleZBVZeroBubble, 2, "v"),
}
MULTI = {"interleaved-1f1b", "zbv"}  # schedules that take a list of stages per process


def stages_per_rank(schedule: str) -> int:
    check_schedule(schedule)
    return SCHEDULES[schedule][1]


def check_schedule(schedule: str) -> None:
    if schedule not in SCHEDULES:
        raise ConfigError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")


def check_pipeline(cfg: GPTConfig, ranks: int, schedule: str, micro_batches: int,
                   batch: int | None = None) -> None:
    """One line (:class:`ConfigError`) for a pipeline that cannot be built, before any work."""
    check_schedule(schedule)
    stages = ranks * stages_per_rank(schedule)
    rules = [
        (ranks >= 1, f"a pipeline needs >= 1 process, got {ranks}"),
        (stages <= cfg.layers, f"{schedule} on {ranks} processes has {stages} stages, more than "
                               f"the GPT's {cfg.layers} blocks: every stage needs a block"),
        (micro_batches >= 1, f"--micro-batches must be >= 1, got {micro_batches}"),
        (batch is None or batch % micro_batches == 0,
         f"a batch of {batch} sequences does not cut into {micro_batches} equal micro-batches"),
    ]
    if schedule == "1f1b":
        rules.append((micro_batches >= ranks, f"1f1b on {ranks} processes needs at least "
                      f"{ranks} micro-batches (one in flight per stage), got {micro_batches}"))
    if schedule == "interleaved-1f1b":  # torch's rule: m in rounds of m // p micro-batches
        rounds = max(1, micro_batches // max(ranks, 1))
        rules.append((micro_batches % rounds == 0,
                      f"interleaved-1f1b on {ranks} processes runs {micro_batches} micro-batches "
                      f"in {rounds} rounds, and {rounds} does not divide {micro_batches}"))
    for ok, message in rules:
        if not ok:
            raise ConfigError(message)


# --- Which blocks each stage holds, and which stages each process runs -----------------------


def block_bounds(layers: int, n_stages: int) -> list[tuple[int, int]]:
    """``[start, end)`` blocks of each stage: as equal as whole blocks allow, the larger first.

    The first stage also holds the embedding and the last the final norm and the output layer;
    at the book's sizes (vocabulary 256) those weigh less than a block, so blocks alone set the
    balance.
    """
    if not 1 <= n_stages <= layers:
        raise ConfigError(f"{n_stages} stages for {layers} blocks: every stage needs a block")
    sizes = [layers // n_stages + (i < layers % n_stages) for i in range(n_stages)]
    starts = [sum(sizes[:i]) for i in range(n_stages)]
    return [(s, s + n) for s, n in zip(starts, sizes, strict=True)]


def stage_indices(schedule: str, rank: int, ranks: int) -> list[int]:
    """The stages process ``rank`` runs: ``rank`` (one per process); ``rank, rank + p, ...``
    (interleaved, a loop); ``rank`` and ``2p - 1 - rank`` (ZB-V: down the V and back up, so
    the first and the last stage share process 0 and the loss needs no hop)."""
    _, v, style = SCHEDULES[schedule]
    if style == "v":
        return [rank, 2 * ranks - 1 - rank]
    return [rank + k * ranks for k in range(v)]


# --- A stage of the GPT, built and initialised alone ----------------------------------------


class GPTStage(nn.Module):
    """Blocks ``start..end-1`` of a GPT, with the embedding if first, the norm and head if last.

    Token indices in (first stage), activations (batch, seq, dim) between stages, logits out
    (last stage). Activations leave contiguous: ``torch.distributed`` sends only those.
    ``positions``: where in the whole sequence the tokens stand, for the first stage's
    position embedding (None: ``0 .. seq-1``; a context-parallel rank sets its own).
    """

    def __init__(self, embed: nn.Module | None, blocks: Sequence[nn.Module],
                 norm: nn.Module | None, head: nn.Module | None, index: int = 0) -> None:
        super().__init__()
        self.embed, self.norm, self.head = embed, norm, head
        self.blocks = nn.ModuleList(blocks)
        self.index = index  # the stage's place in the pipeline, for the activation meter
        self.positions: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x, self.positions)
        for block in self.blocks:
            x = block(x)
        if self.head is not None:
            x = self.head(self.norm(x))
        return x.contiguous()


def init_unit(unit: nn.Module, index: int, cfg: GPTConfig, seed: int = 0) -> None:
    """Initialise one unit of the GPT (unit 0 the embedding, 1..L the blocks, L+1 the norm,
    L+2 the head) as ``GPT.__init__`` does, from the seed ``seed + index``.

    The same weights whichever process builds the unit and whether the others exist: a stage
    and the whole model built unit by unit agree to the bit. Every tensor is set (the unit may
    come from ``to_empty``, whose memory is uninitialised): ``reset_parameters`` first (the
    norms), then GPT's rule (normal(0, 0.02) weights, zero biases), then the residual
    projections scaled down with depth.
    """
    with torch.random.fork_rng(devices=[]):  # CPU generator only: the caller's stream stays
        torch.manual_seed(seed + index)
        for m in unit.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
        unit.apply(GPT._init)
        scale_residuals(unit, cfg.layers)


def _units(model: GPT) -> list[nn.Module]:
    return [model.embed, *model.blocks, model.norm, model.head]


def _materialise(units: list[tuple[int, nn.Module]], cfg: GPTConfig, device: torch.device,
                 seed: int) -> None:
    for index, unit in units:
        if device.type == "meta":  # shapes only
            unit.to_empty(device=device)
            continue
        # on the CPU (one generator: the same numbers on every machine), then to the device
        unit.to_empty(device="cpu")  # uninitialised memory: init_unit sets every tensor
        init_unit(unit, index, cfg, seed)
        unit.to(device)


def reference_gpt(cfg: GPTConfig, device: torch.device, seed: int = 0) -> GPT:
    """The whole GPT in one process, unit by unit, with the weights the stages get."""
    with torch.device("meta"):
        model = GPT(cfg)
    _materialise(list(enumerate(_units(model))), cfg, device, seed)
    return model


def build_stage_module(cfg: GPTConfig, stage: int, n_stages: int, device: torch.device,
                       seed: int = 0) -> GPTStage:
    """Stage ``stage`` of ``n_stages``, allocated on ``device``; nothing else is allocated."""
    start, end = block_bounds(cfg.layers, n_stages)[stage]
    with torch.device("meta"):
        model = GPT(cfg)  # shapes only
    first, last = stage == 0, stage == n_stages - 1
    held = ([(0, model.embed)] if first else []) + \
        [(1 + i, model.blocks[i]) for i in range(start, end)] + \
        ([(cfg.layers + 1, model.norm), (cfg.layers + 2, model.head)] if last else [])
    _materialise(held, cfg, device, seed)
    return GPTStage(model.embed if first else None, list(model.blocks[start:end]),
                    model.norm if last else None, model.head if last else None, index=stage)


def stage_parameter_names(cfg: GPTConfig, stage: int, n_stages: int) -> list[str]:
    """The names in the whole GPT of a stage's parameters, in the stage's order."""
    start, end = block_bounds(cfg.layers, n_stages)[stage]
    with torch.device("meta"):
        module = build_stage_module(cfg, stage, n_stages, torch.device("meta"))
    names = []
    for name, _ in module.named_parameters():
        part, _, rest = name.partition(".")
        if part == "blocks":
            i, _, rest = rest.partition(".")
            name = f"blocks.{start + int(i)}.{rest}"
        names.append(name)
    return names


# --- The pipeline: stages and a schedule --------------------------------------------------


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return lm_loss(logits, target)


@dataclass
class Pipeline:
    """This process's stages (their modules and ``PipelineStage`` s) and the schedule."""

    schedule_name: str
    schedule: object
    stages: list[PipelineStage]
    modules: list[GPTStage]
    indices: list[int]

    @property
    def has_first(self) -> bool:
        return any(s.is_first for s in self.stages)

    @property
    def has_last(self) -> bool:
        return any(s.is_last for s in self.stages)

    def parameters(self) -> Iterator[nn.Parameter]:
        for m in self.modules:
            yield from m.parameters()

    def zero_grad(self) -> None:
        for m in self.modules:
            m.zero_grad(set_to_none=True)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        """Forward and backward of one batch through every stage of every process.

        Every process calls it with the same batch (only the first stage reads ``x``, only the
        last ``y``). Returns the last stage's loss per micro-batch (empty on other processes).
        The gradients are those of the batch's mean loss: the schedule divides each stage's
        summed micro-batch gradients by their number.
        """
        self.zero_grad()
        losses: list[torch.Tensor] = []
        inputs = (x,) if self.has_first else ()
        labels = {"target": y, "losses": losses} if self.has_last else {}
        self.schedule.step(*inputs, **labels)
        return losses


class _Stage(PipelineStage):
    """A ``PipelineStage`` whose first handshake sends nothing to its own process.

    Under a V (ZB-V), stages p-1 and p share the last process. torch 2.11 opens every stage's
    links with a send to each neighbour, its own process included, which gloo cannot do
    ("Pair is not connected"); torch 2.14 skips such sends, as this does. Between stages of
    one process, activations pass in memory in both versions.
    """

    def _get_init_p2p_neighbors_ops(self):
        ops = super()._get_init_p2p_neighbors_ops()
        me = self.group_rank
        return [op for op in ops if op.group_peer != me]


def build_pipeline(cfg: GPTConfig, schedule: str, rank: int, ranks: int, micro_batches: int,
                   device: torch.device, group=None, seed: int = 0,
                   wrap=None) -> Pipeline:
    """This process's stages of the GPT under ``schedule``, over the process group ``group``
    (default: every process), ``rank`` being this process's rank in it.

    ``wrap(module)``, if given, is applied to each stage's module before it becomes a
    ``PipelineStage`` (tensor parallelism and FSDP inside a stage, :mod:`.hybrid`).
    """
    check_pipeline(cfg, ranks, schedule, micro_batches)
    kind, v, _ = SCHEDULES[schedule]
    n_stages = ranks * v
    indices = stage_indices(schedule, rank, ranks)
    modules = [build_stage_module(cfg, i, n_stages, device, seed) for i in indices]
    if wrap is not None:
        modules = [wrap(m) for m in modules]
    stages = [_Stage(m, i, n_stages, device, group=group)
              for m, i in zip(modules, indices, strict=True)]
    runner = kind(stages if schedule in MULTI else stages[0], micro_batches, loss_fn=loss_fn)
    return Pipeline(schedule, runner, stages, modules, indices)


# --- What the schedules should leave idle, and hold -----------------------------------------


def bubble_fraction(schedule: str, ranks: int, micro_batches: int, v: int | None = None) -> float:
    """The idle fraction of a process's step, as each schedule's paper predicts it.

    With p processes and m micro-batches of equal cost, a forward of one stage taking t_F and
    a backward t_B:

    - GPipe and 1F1B: the first micro-batch's forward reaches the last process after (p-1) t_F
      and the last backward leaves the first process (p-1) t_B after the last process is done:
      each process idles (p-1)(t_F + t_B) of a step of (m + p - 1)(t_F + t_B), a fraction
      (p-1)/(m+p-1) (Huang et al., 2019). 1F1B only reorders the same work to hold fewer
      activations (Narayanan et al., 2019): the same bubble.
    - Interleaved 1F1B with v stages per process: each stage is 1/v of a process's layers, so
      the fill and drain take (p-1)(t_F + t_B)/v, and the fraction is (p-1)/(v m + p - 1)
      (Narayanan et al., 2021, eq. 2 written as a fraction of the step).
    - ZB-V: 0 (Qi et al., 2024) in the ideal that paper assumes: a forward, an input-backward
      and a weight-backward each take the same time, sends are free, and there are micro-batches
      enough to reach the steady state. In practice it is never exactly zero: the
      weight-backwards that fill the gaps are not exactly as long as them, and every hop costs.
    """
    check_schedule(schedule)
    p, m = ranks, micro_batches
    v = v or stages_per_rank(schedule)
    if schedule == "zbv":
        return 0.0
    if schedule == "interleaved-1f1b":
        return (p - 1) / (v * m + p - 1)
    return (p - 1) / (m + p - 1)


def interleaved_warmup(rank: int, ranks: int, micro_batches: int, v: int = 2) -> int:
    """Forwards process ``rank`` runs before its first backward in torch's interleaved 1F1B
    (counted in stage-micro-batches, each 1/v of the process's layers): the last process runs
    the (v-1) rounds of its earlier stages, and each hop towards the first adds two."""
    rounds = max(1, micro_batches // ranks)
    per_round = micro_batches // rounds
    return min((v - 1) * per_round + 2 * (ranks - 1 - rank), micro_batches * v)


def in_flight(schedule: str, rank: int, ranks: int, micro_batches: int) -> float:
    """Micro-batches whose activations process ``rank`` holds at its peak, in units of one
    micro-batch through all of the process's layers (a stage of a 2-stage-per-process schedule
    counts 1/2).

    - GPipe: every forward runs before the first backward: m.
    - 1F1B: process r starts its backwards after p - r forwards, then frees one micro-batch
      per new one: min(m, p - r). The first process holds p, the last 1.
    - Interleaved 1F1B: the warm-up forwards (:func:`interleaved_warmup`) plus the one
      steady-state forward, over v: about p + (p - 1 - 2r)/v on process r for m >= p;
      more on the first process than 1F1B's p, which is the price of the smaller bubble.
    - ZB-V: the V puts process r's two stages at depths r and 2p - 1 - r, so each process
      holds p micro-batches' worth once m >= 2p, like 1F1B's first process, but the same on
      every process (:func:`zbv_in_flight`).
    """
    check_schedule(schedule)
    p, m, r = ranks, micro_batches, rank
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(m, p - r))
    if schedule == "interleaved-1f1b":
        return min(interleaved_warmup(r, p, m) + 1, 2 * m) / 2
    return zbv_in_flight(r, p, m) / 2


def zbv_in_flight(rank: int, ranks: int, micro_batches: int) -> int:
    """Stage-micro-batches process ``rank`` holds at its peak under ZB-V:
    min(2m, m + 1 + r, 2p).

    Process r's stages sit at depths r and 2p-1-r of the V. Before its first weight-backward
    frees anything it runs the forwards of its first stage for every micro-batch that can be
    ahead, plus those of its second stage until the first backward comes back: m + 1 + r of
    them when m is small, capped at 2p, where each new forward is matched by a weight-backward
    (the steady state), and at 2m, everything. For m >= 2p that is 2p on every process: p
    micro-batches of the process's layers, 1F1B's first process (Qi et al., 2024, Table 3:
    ZB-V's activation memory is 1F1B's). Counted here from torch's own list of actions
    (:func:`schedule_peak`), which agrees for 2 and 4 processes and m from 1 to 12.
    """
    return min(2 * micro_batches, micro_batches + 1 + rank, 2 * ranks)


_ACTION = re.compile(r"^(\d+)([A-Z_]+)(\d*)$")


def schedule_peak(actions: Sequence) -> int:
    """The peak of (forwards run - micro-batches freed) over one process's list of actions
    (a torch schedule's ``pipeline_order[rank]``): a forward (F) keeps its activations until
    the full backward (B) or, with the backward split, the weight-backward (W)."""
    held = peak = 0
    for a in actions:
        found = _ACTION.match(str(a)) if a is not None else None
        kind = found.group(2) if found else ""
        held += {"F": 1, "B": -1, "W": -1}.get(kind, 0)
        peak = max(peak, held)
    return peak


# --- Measuring what a stage holds ------------------------------------------------------------


class _Saved:
    """What autograd keeps instead of a saved tensor while the meter runs: the tensor itself,
    and a note to the meter when autograd lets it go (after that micro-batch's backward)."""

    __slots__ = ("tensor", "key", "ptr", "meter", "__weakref__")

    def __init__(self, tensor, key, ptr, meter) -> None:
        self.tensor, self.key, self.ptr, self.meter = tensor, key, ptr, meter

    def __del__(self) -> None:
        meter = self.meter()
        if meter is not None:
            meter._release(self.key, self.ptr)


class ActivationMeter:
    """Counts, while it is active, the tensors autograd keeps for backward, as long as they live.

    Each stage's forward is tagged with (stage, how many forwards it has run), so the meter
    knows how many stage-micro-batches have activations alive at each moment, and their bytes
    (each storage once; the parameters, which autograd also saves, not at all). ``peak_chunks``
    and ``peak_bytes`` are the largest values seen. A tensor is released when autograd drops
    it: after its micro-batch's backward, or, in a zero-bubble schedule, after the
    weight-backward, the last one that needs the layer's input.
    """

    def __init__(self, modules: Sequence[GPTStage]) -> None:
        self.skip = {p.untyped_storage().data_ptr() for m in modules for p in m.parameters()}
        self.calls = {id(m): 0 for m in modules}
        self.current: tuple[int, int] | None = None
        self.storages: dict[int, list[int]] = {}  # ptr -> [bytes, references]
        self.chunks: dict[tuple[int, int], int] = {}  # (stage, call) -> live references
        self.bytes = self.peak_bytes = self.peak_chunks = 0
        self.handles = [m.register_forward_pre_hook(self._tag) for m in modules]

    def _tag(self, module, _args) -> None:
        if torch.is_grad_enabled():
            self.calls[id(module)] += 1
            self.current = (module.index, self.calls[id(module)])

    def _pack(self, t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.skip or self.current is None:
            return t
        entry = self.storages.setdefault(ptr, [t.untyped_storage().nbytes(), 0])
        if entry[1] == 0:
            self.bytes += entry[0]
        entry[1] += 1
        self.chunks[self.current] = self.chunks.get(self.current, 0) + 1
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        self.peak_chunks = max(self.peak_chunks, len(self.chunks))
        # detached: the same storage without the graph. A saved output holding its own grad_fn
        # would make a cycle through C++ that no garbage collector sees, and leak
        return _Saved(t.detach(), self.current, ptr, weakref.ref(self))

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, key, ptr) -> None:
        entry = self.storages[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.bytes -= entry[0]
            del self.storages[ptr]
        self.chunks[key] -= 1
        if self.chunks[key] == 0:
            del self.chunks[key]

    def reset(self) -> None:
        self.peak_bytes, self.peak_chunks = self.bytes, len(self.chunks)

    @contextlib.contextmanager
    def active(self) -> Iterator[ActivationMeter]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield self

    def close(self) -> None:
        for h in self.handles:
            h.remove()
