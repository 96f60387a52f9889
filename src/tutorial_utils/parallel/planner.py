"""Choosing a layout: memory and step time of every dp x tp x pp x cp split of N GPUs, predicted.

From the model's shape (:class:`ModelShape`), the GPU (:class:`Hardware`: memory, dense peak
FLOP/s and an efficiency, the links' latency and bandwidth as chapter 3b's alpha-beta model)
and a layout (:class:`Layout`), :func:`predict` gives the memory of the most loaded GPU and the
time of one training step; :func:`plan` does it for every layout of N GPUs that divides the
model, marks those that do not fit, and :func:`best` picks the fastest that fits.
:func:`compare` sets the predictions beside measured step times, with the error.

**Memory per GPU** (bytes), for the pipeline stage that holds the most:

- parameters, gradients and optimizer state: the parameter values a GPU holds
  (:func:`params_per_gpu`, exact: a block's ``q``, ``k``, ``v``, ``fc`` and their biases, ``o``
  and ``proj`` split over tp, their two biases and the norms whole; the embedding whole on the
  first stage; the output layer split over tp on the last), times the bytes per parameter of
  ZeRO's accounting (:func:`tutorial_utils.memory.bytes_per_param`, Rajbhandari et al., 2020),
  the sharded parts divided over the dp x cp ranks that hold the same values;
- activations (:func:`activation_bytes`): what autograd keeps per block and token, counted on
  this GPT with :func:`tutorial_utils.memory.saved_tensors` (PyTorch's CPU attention, which
  keeps q, k, v, the output and a logsumexp per head, never the seq x seq scores)::

      4d + 12d/tp values (the norms' inputs and outputs whole; q, k, v, attention's output,
      the MLP's 4d hidden before and after GELU split over tp)
      + (4 + heads/tp) float32 (the norms' mean and 1/std, attention's logsumexp)

  for the tokens of one micro-batch on one GPU (micro-batch x seq / cp), times the blocks of
  the stage, times the micro-batches the schedule holds in flight on that stage
  (:func:`tutorial_utils.parallel.gpt_pipeline.in_flight`); the last stage adds the final norm
  and the float32 log-probabilities of the loss (vocabulary values per token). The same count
  as Korthikanti et al. (2022) without dropout and with attention that keeps no scores.

**Step time** = compute / (1 - bubble) + the communication of each dimension, none of it
assumed hidden behind compute (an upper bound where the frameworks overlap):

- compute: the model's FLOPs per step (6 per parameter and token plus attention's
  12 L s d, :func:`tutorial_utils.models.gpt.flops_per_token`) over dp x tp x pp x cp GPUs
  running at ``peak x efficiency`` (efficiency 0.4 by default for GPUs: large models train at
  35 to 50 % of the dense bf16 peak);
- pipeline: its bubble (:func:`tutorial_utils.parallel.gpt_pipeline.bubble_fraction`), and per
  micro-batch and stage of a process one activation sent forward and one gradient sent back
  (interleaved 1F1B and ZB-V run 2 stages a process: twice the sends);
- tensor: 4 all-reduces per block and micro-batch of the micro-batch's activations
  (:func:`tutorial_utils.parallel.tensor.tp_bytes_per_step`);
- context: per block and micro-batch, cp - 1 ring steps passing this rank's keys and values
  forward (2 tensors) and keys, values and their gradients backward (4);
- data: the gradients of the GPU's parameters all-reduced over dp x cp (replicated, ZeRO-1,
  ZeRO-2), or with ZeRO-3 (FSDP) the parameters all-gathered for forward and again for backward
  and the gradients reduce-scattered, once per block and once for the rest.

Each collective of n bytes over g GPUs costs ``alpha + bus_factor(g) x n / bus_bandwidth``
(chapter 3b, :func:`tutorial_utils.parallel.collectives.bus_factor`): the link of a node when
the group fits in one (:class:`Hardware` ``gpus_per_node``), else the link between nodes; the
dimensions are laid out tp innermost, then cp, pp, dp, as :mod:`.hybrid` builds its mesh.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..config import ConfigError
from ..memory import bytes_per_param
from ..models.gpt import GPTConfig
from .collectives import AlphaBeta, bus_factor
from .gpt_pipeline import bubble_fraction, check_pipeline, in_flight, stages_per_rank
from .tensor import tp_bytes_per_step


@dataclass(frozen=True)
class ModelShape:
    """The GPT's shape and one step's work: ``batch`` sequences of ``seq`` tokens."""

    layers: int
    dim: int
    heads: int
    seq: int
    batch: int
    vocab: int = 256

    @classmethod
    def of(cls, cfg: GPTConfig, batch: int) -> ModelShape:
        return cls(cfg.layers, cfg.dim, cfg.heads, cfg.seq, batch, cfg.vocab)

    @property
    def gpt(self) -> GPTConfig:
        return GPTConfig(vocab=self.vocab, seq=self.seq, layers=self.layers, heads=self.heads,
                         dim=self.dim)

    def block_params(self, tp: int = 1) -> int:
        """A block's parameter values on one of ``tp`` ranks: 12 d^2 + 7 d split, 6 d whole."""
        d = self.dim
        return 12 * d * d // tp + 7 * d // tp + 6 * d

    @property
    def params(self) -> int:
        d = self.dim
        return (self.layers * self.block_params() + (self.vocab + self.seq) * d + 2 * d
                + self.vocab * d)

    @property
    def flops_per_step(self) -> float:
        """Training FLOPs of one step: (6 N + 12 L s d) per token (the PaLM paper's count)."""
        from ..models.gpt import flops_per_token

        return flops_per_token(self.gpt, self.params) * self.batch * self.seq


@dataclass(frozen=True)
class Link:
    """One collective of n bytes on g ranks: alpha + bus_factor(g) x n / bus_bytes_per_s."""

    alpha_s: float
    bus_bytes_per_s: float

    @classmethod
    def from_all_reduce_fit(cls, fit: AlphaBeta, world: int) -> Link:
        """From chapter 3b's fit of all-reduce times on ``world`` ranks, whose beta is in
        buffer bytes per second (algorithm bandwidth): the bus bandwidth is beta x 2(N-1)/N."""
        return cls(fit.alpha_s, fit.beta * bus_factor("all_reduce", world))

    def seconds(self, collective: str, nbytes: float, group: int) -> float:
        if group <= 1:
            return 0.0
        factor = 1.0 if collective == "send" else bus_factor(collective, group)
        return self.alpha_s + factor * nbytes / self.bus_bytes_per_s


@dataclass(frozen=True)
class Hardware:
    """A GPU (or a CPU process standing in for one) and its links."""

    name: str
    memory_bytes: float
    peak_flops: float  # dense, in the precision trained (bf16 on GPUs)
    link: Link  # inside a node
    efficiency: float = 0.4  # the fraction of the peak a training step reaches
    gpus_per_node: int = 8
    inter_node: Link | None = None  # between nodes (default: the same as inside)
    usable: float = 0.9  # of the memory: the rest for the allocator, workspaces, the CUDA context


# NVIDIA's datasheets: H100 SXM 80 GB and H200 141 GB, 989 dense bf16 TFLOP/s each. The link:
# 360 GB/s of all-reduce bus bandwidth measured between the workplace's H100s over NVLink
# (1 GiB messages), 20 us of latency (an assumption: NCCL's small-message time on NVLink).
H100 = Hardware("H100 SXM", 80e9, 989e12, Link(20e-6, 360e9))
H200 = Hardware("H200", 141e9, 989e12, Link(20e-6, 360e9))


@dataclass(frozen=True)
class Layout:
    """How N GPUs split the work: ``micro_batch`` sequences per micro-batch of a pipeline
    (without one, pp = 1, each dp group runs its share of the batch at once)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    micro_batch: int = 1
    schedule: str = "1f1b"
    zero: str = "ZeRO-3"  # how the dp x cp ranks share the model state (memory.STAGES)

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def sequences(self, model: ModelShape) -> int:
        """Sequences a GPU runs at once: a micro-batch in a pipeline, else its dp group's."""
        return self.micro_batch if self.pp > 1 else model.batch // self.dp

    def micro_batches(self, model: ModelShape) -> int:
        """Micro-batches per dp group and step (1 without a pipeline: no accumulation)."""
        per_group = model.batch // self.dp
        return max(1, per_group // self.micro_batch) if self.pp > 1 else 1

    def __str__(self) -> str:
        return f"dp{self.dp} tp{self.tp} pp{self.pp} cp{self.cp}"


@dataclass(frozen=True)
class Recipe:
    """What a parameter and an activation cost: ``optimizer`` and ``precision`` as in
    :data:`tutorial_utils.memory.BYTES_PER_PARAM` ("mixed": 16-bit weights and gradients, an
    fp32 master copy; "fp32": as this book trains on the CPU)."""

    optimizer: str = "adam"
    precision: str = "mixed"

    @property
    def value_bytes(self) -> int:
        """Bytes of an activation or a gradient on the wire."""
        return 2 if self.precision == "mixed" else 4


def check_layout(model: ModelShape, layout: Layout, gpus: int) -> None:
    """One line (:class:`ConfigError`) for a layout that cannot run, before any work."""
    rules = [
        (min(layout.dp, layout.tp, layout.pp, layout.cp, layout.micro_batch) >= 1,
         f"every dimension and the micro-batch must be >= 1, got {layout}"),
        (layout.gpus == gpus, f"the mesh {layout} holds {layout.gpus} GPUs, not {gpus}: the "
                              f"product of its sizes must be {gpus}"),
        (model.heads % layout.tp == 0, f"{model.heads} heads do not split over tp={layout.tp}: "
                                       "tensor parallelism gives each rank whole heads"),
        (layout.pp <= model.layers, f"pp={layout.pp} stages for {model.layers} blocks: more "
                                    "stages than blocks"),
        (model.layers % layout.pp == 0, f"{model.layers} blocks do not split evenly over "
                                        f"pp={layout.pp} stages"),
        (layout.cp == 1 or model.seq % (2 * layout.cp) == 0,
         f"a sequence of {model.seq} tokens cannot be split by a ring of cp={layout.cp}: the "
         f"zig-zag split needs a multiple of 2 x cp = {2 * layout.cp}"),
        (model.batch % layout.dp == 0, f"a batch of {model.batch} sequences does not split "
                                       f"over dp={layout.dp} groups"),
        ((model.batch // max(layout.dp, 1)) % layout.micro_batch == 0,
         f"{model.batch // max(layout.dp, 1)} sequences per dp group do not cut into "
         f"micro-batches of {layout.micro_batch}"),
    ]
    for ok, message in rules:
        if not ok:
            raise ConfigError(message)
    if layout.pp > 1:
        check_pipeline(model.gpt, layout.pp, layout.schedule, layout.micro_batches(model))


# --- Memory ---------------------------------------------------------------------------------


def stage_blocks(model: ModelShape, layout: Layout) -> int:
    return model.layers // layout.pp


def params_per_gpu(model: ModelShape, layout: Layout, stage: int) -> int:
    """Parameter values of pipeline stage ``stage`` on one tp rank, before any dp sharding."""
    d, last = model.dim, stage == layout.pp - 1
    n = stage_blocks(model, layout) * model.block_params(layout.tp)
    if stage == 0:
        n += (model.vocab + model.seq) * d  # embeddings: whole on every tp rank
    if last:
        n += 2 * d + model.vocab * d // layout.tp  # the final norm whole, the head split
    return n


def activation_bytes(model: ModelShape, layout: Layout, recipe: Recipe, stage: int) -> float:
    """Bytes saved for backward on stage ``stage`` at its peak (see the module's docstring)."""
    d, tp, vb = model.dim, layout.tp, recipe.value_bytes
    tokens = layout.sequences(model) * model.seq / layout.cp  # one micro-batch on one GPU
    per_block = tokens * ((4 * d + 12 * d / tp) * vb + (4 + model.heads / tp) * 4)
    held = stage_blocks(model, layout) * per_block
    if stage == layout.pp - 1:  # the final norm and the loss's float32 log-probabilities
        held += tokens * (2 * d * vb + 2 * 4 + model.vocab * 4)
    if stage == 0:
        held += tokens * 8  # the token ids, int64
    m = layout.micro_batches(model)
    flight = in_flight(layout.schedule, stage, layout.pp, m) if layout.pp > 1 else 1
    return flight * held


@dataclass(frozen=True)
class Memory:
    """Bytes on the most loaded GPU."""

    stage: int
    parameters: float
    gradients: float
    optimizer: float
    activations: float

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer + self.activations


def memory(model: ModelShape, layout: Layout, recipe: Recipe = Recipe()) -> Memory:
    """The memory of the stage that needs the most."""
    shards = layout.dp * layout.cp  # ranks that hold the same parameter values
    per = []
    for stage in range(layout.pp):
        n = params_per_gpu(model, layout, stage)
        p, g, o = _split_bytes(recipe, layout.zero, shards)
        per.append(Memory(stage, n * p, n * g, n * o,
                          activation_bytes(model, layout, recipe, stage)))
    return max(per, key=lambda mem: mem.total)


def _split_bytes(recipe: Recipe, zero: str, shards: int) -> tuple[float, float, float]:
    """Bytes per parameter of (weights, gradients, optimizer state) on one rank under ZeRO
    stage ``zero`` over ``shards`` ranks: the split of ``memory.bytes_per_param``'s sum."""
    from ..memory import BYTES_PER_PARAM, STAGES

    parts = BYTES_PER_PARAM[(recipe.optimizer, recipe.precision)]
    sharded = STAGES.index(zero)
    split = tuple(b / shards if i >= 3 - sharded else b for i, b in enumerate(parts))
    assert sum(split) == bytes_per_param(recipe.optimizer, recipe.precision, zero, shards)
    return split


# --- Time -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepTime:
    """Seconds of one step, by where they go."""

    compute: float
    bubble: float
    tp: float
    pp: float
    cp: float
    dp: float

    @property
    def total(self) -> float:
        return self.compute + self.bubble + self.tp + self.pp + self.cp + self.dp


def _link(hw: Hardware, layout: Layout, dim: str) -> Link:
    """The link a dimension's groups use: inside a node if a group's span fits in one."""
    order = ("tp", "cp", "pp", "dp")
    span = math.prod(getattr(layout, d) for d in order[: order.index(dim) + 1])
    inside = span <= hw.gpus_per_node or getattr(layout, dim) == 1
    return hw.link if inside else (hw.inter_node or hw.link)


def step_time(model: ModelShape, layout: Layout, hw: Hardware,
              recipe: Recipe = Recipe()) -> StepTime:
    """The model of the module's docstring, for one layout."""
    vb, m = recipe.value_bytes, layout.micro_batches(model)
    compute = model.flops_per_step / layout.gpus / (hw.peak_flops * hw.efficiency)
    bubble = 0.0
    if layout.pp > 1:
        f = bubble_fraction(layout.schedule, layout.pp, m)
        bubble = compute * f / (1 - f)
    tokens = layout.sequences(model) * model.seq / layout.cp  # one micro-batch on one GPU
    n_mb = m if layout.pp > 1 else 1
    blocks = stage_blocks(model, layout)
    tp_link, pp_link = _link(hw, layout, "tp"), _link(hw, layout, "pp")
    cp_link, dp_link = _link(hw, layout, "cp"), _link(hw, layout, "dp")
    # tp: 4 all-reduces per block and micro-batch (tp_bytes_per_step counts their bus bytes)
    per_reduce = tp_bytes_per_step(tokens, model.dim, 1, layout.tp, vb) / 4
    tp = 4 * blocks * n_mb * (tp_link.alpha_s + per_reduce / tp_link.bus_bytes_per_s) \
        if layout.tp > 1 else 0.0
    # pp: an activation forward and a gradient back per micro-batch and stage of the process
    # (v stages each for interleaved 1F1B and ZB-V: v times the sends)
    v = stages_per_rank(layout.schedule) if layout.pp > 1 else 1
    pp = 2 * v * n_mb * pp_link.seconds("send", tokens * model.dim * vb, layout.pp)
    # cp: (cp - 1) ring steps per block and micro-batch: K, V forward; K, V, dK, dV backward
    kv = tokens * model.dim / layout.tp * vb
    cp = 6 * (layout.cp - 1) * blocks * n_mb * cp_link.seconds("send", kv, layout.cp)
    # dp (with cp): the GPU's gradients, or ZeRO-3's gathers and reduce-scatter
    shards = layout.dp * layout.cp
    n = max(params_per_gpu(model, layout, s) for s in range(layout.pp))
    grad_bytes = n * vb
    if layout.zero == "ZeRO-3":
        units = blocks + 1
        dp = 3 * ((units - 1) * dp_link.alpha_s + dp_link.seconds("all_gather", grad_bytes,
                                                                  shards)) \
            if shards > 1 else 0.0
    else:
        dp = dp_link.seconds("all_reduce", grad_bytes, shards)
    return StepTime(compute, bubble, tp, pp, cp, dp)


# --- Every layout ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """One layout's predictions."""

    layout: Layout
    memory: Memory
    time: StepTime
    fits: bool

    @property
    def step_ms(self) -> float:
        return self.time.total * 1e3

    def row(self) -> dict:
        gib = 2**30
        return {"layout": str(self.layout), "fits": self.fits,
                "params_gib": self.memory.parameters / gib,
                "grads_gib": self.memory.gradients / gib,
                "optimizer_gib": self.memory.optimizer / gib,
                "activations_gib": self.memory.activations / gib,
                "memory_gib": self.memory.total / gib, "step_ms": self.step_ms}


def predict(model: ModelShape, layout: Layout, hw: Hardware, recipe: Recipe = Recipe()) -> Plan:
    check_layout(model, layout, layout.gpus)
    mem = memory(model, layout, recipe)
    return Plan(layout, mem, step_time(model, layout, hw, recipe),
                mem.total <= hw.memory_bytes * hw.usable)


def layouts(model: ModelShape, gpus: int, micro_batch: int = 1, schedule: str = "1f1b",
            zero: str = "ZeRO-3") -> list[Layout]:
    """Every dp x tp x pp x cp = ``gpus`` that divides the model (heads by tp, blocks by pp,
    the sequence by 2 cp, the batch by dp and micro-batches) and that the schedule can run."""
    found = []
    sizes = [d for d in range(1, gpus + 1) if gpus % d == 0]
    for dp, tp, pp in itertools.product(sizes, repeat=3):
        if gpus % (dp * tp * pp):
            continue
        layout = Layout(dp, tp, pp, gpus // (dp * tp * pp), micro_batch, schedule, zero)
        try:
            check_layout(model, layout, gpus)
        except ConfigError:
            continue
        found.append(layout)
    return found


def plan(model: ModelShape, gpus: int, hw: Hardware, recipe: Recipe = Recipe(),
         **layout_options) -> list[Plan]:
    """Every layout's predictions, the fastest first."""
    return sorted((predict(model, lay, hw, recipe)
                   for lay in layouts(model, gpus, **layout_options)),
                  key=lambda p: p.time.total)


def best(plans: Sequence[Plan]) -> Plan:
    """The fastest layout that fits; a one-line error when none does."""
    fitting = [p for p in plans if p.fits]
    if not fitting:
        smallest = min(plans, key=lambda p: p.memory.total, default=None)
        need = f": the smallest needs {smallest.memory.total / 2**30:.1f} GiB per GPU" \
            if smallest else ""
        raise ConfigError(f"no layout fits in memory{need}")
    return min(fitting, key=lambda p: p.time.total)


# --- Predictions against measurements -------------------------------------------------------


@dataclass(frozen=True)
class Measurement:
    """A step time measured on some layout of some model, to set beside the prediction."""

    label: str
    model: ModelShape
    layout: Layout
    measured_ms: float
    recipe: Recipe = field(default_factory=Recipe)


@dataclass(frozen=True)
class ErrorRow:
    label: str
    layout: str
    measured_ms: float
    predicted_ms: float

    @property
    def error_pct(self) -> float:
        """(predicted - measured) / measured, in percent: positive when the model is slow."""
        return 100 * (self.predicted_ms / self.measured_ms - 1)


def compare(measurements: Sequence[Measurement], hw: Hardware) -> list[ErrorRow]:
    """The planner's prediction beside each measurement, with the error."""
    return [ErrorRow(m.label, str(m.layout), m.measured_ms,
                     step_time(m.model, m.layout, hw, m.recipe).total * 1e3)
            for m in measurements]


def cpu_hardware(matmul_flops: float, link: Link, processes: int, cores: int,
                 efficiency: float = 1.0, memory_bytes: float = 8e9) -> Hardware:
    """CPU processes standing in for GPUs: each gets its share of the cores' matrix-product
    rate (measured: :func:`matmul_flops`) at ``efficiency`` (fit it with
    :func:`fitted_efficiency` on one process at the same size), and gloo's link as fitted by
    chapter 3b. Where there are fewer cores than processes, they share them."""
    share = min(1.0, cores / processes)
    return Hardware(f"{processes} CPU processes on {cores} cores", memory_bytes,
                    matmul_flops * share, link, efficiency=efficiency, gpus_per_node=processes)


def fitted_efficiency(cfg: GPTConfig, sequences: int, peak_flops: float, repeats: int = 5,
                      threads: int | None = 1) -> float:
    """The fraction of ``peak_flops`` one process reaches on a forward and backward of the
    whole GPT on ``sequences`` sequences (float32, ``threads`` threads): the efficiency to
    predict CPU runs with. At the book's CPU sizes a step is hundreds of small operations,
    whose per-call cost, not their FLOPs, sets the time: a matrix product's rate alone would
    predict them many times too fast."""
    import torch

    from ..models.gpt import GPT, lm_loss
    from ..timing import benchmark

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        model = GPT(cfg)
        x = torch.randint(0, cfg.vocab, (sequences, cfg.seq))

        def step() -> None:
            lm_loss(model(x), x).backward()
            model.zero_grad(set_to_none=True)

        t = benchmark(step, warmup=2, repeats=repeats).median_ms / 1e3
    finally:
        torch.set_num_threads(before)
    return ModelShape.of(cfg, sequences).flops_per_step / t / peak_flops


def matmul_flops(n: int = 512, repeats: int = 5, threads: int | None = 1) -> float:
    """FLOP/s of an n x n x n float32 matrix product on this CPU (``threads`` threads: the
    pipeline and hybrid workers run one thread per process)."""
    import torch

    from ..timing import benchmark

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        t = benchmark(lambda: a @ b, warmup=2, repeats=repeats).median_ms / 1e3
    finally:
        torch.set_num_threads(before)
    return 2 * n**3 / t
