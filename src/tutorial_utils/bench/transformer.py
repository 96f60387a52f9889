"""Chapter 7's measurements: the GPT on one GPU, its training curve, and TP on N GPUs.

    python -m tutorial_utils.bench.transformer --record           # one GPU: two records
    python -m tutorial_utils.bench.transformer --gpus 2 --record  # TP against FSDP2, N GPUs

On one device: the training step's time, throughput and peak memory at a few batch sizes,
each with and without activation checkpointing (:func:`step_rows`); then a short training run
on the standard library's source (:func:`train`). With ``--gpus N`` it starts
:mod:`tutorial_utils.bench.workers.tp_step` under torchrun, which times FSDP2, TP, TP with
sequence parallelism, and (N >= 4) the 2-D mesh on the same model and global batch.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Literal

import torch

from ..config import Config, ConfigError, check, check_gpus, opt, parse_or_exit
from ..launch import run_worker
from ..models.gpt import GPT, GPTConfig, lm_loss, shape_rules
from ..text import Corpus, batch, stdlib_corpus, synthetic_corpus
from ..timing import benchmark, synchronize
from . import mfu, records
from .report import Column, table

RECORD = "07-tensor-parallel"
ONE_GPU = ("07-gpt-steps", "07-gpt-training")
WHAT = {"07-gpt-steps": "Chapter 7: the GPT's training step on one GPU, with and without "
                        "activation checkpointing",
        "07-gpt-training": "Chapter 7: a short training run of the GPT on one GPU",
        RECORD: "Chapter 7: tensor parallelism against FSDP2 on the GPT, on N GPUs"}
WORKER = "tutorial_utils.bench.workers.tp_step"


@dataclass
class TransformerConfig(Config):
    """The GPT's step, memory and training curve on one device; or TP against FSDP2 on N GPUs."""

    dim: int = opt(768, "model width (768, 12 layers, 12 heads: GPT-2 small's shape)")
    layers: int = opt(12, "transformer blocks")
    heads: int = opt(12, "attention heads")
    seq: int = opt(1024, "bytes per sequence")
    batches: tuple[int, ...] = opt((8, 16, 32), "sequences per step, one row each")
    repeats: int = opt(10, "timed steps per row")
    train_steps: int = opt(600, "steps of the training run (0: none)")
    train_batch: int = opt(32, "sequences per training step")
    lr: float = opt(1e-3, "peak learning rate (AdamW; warm-up, then cosine)")
    data: Literal["stdlib", "synthetic"] = opt("stdlib", "the text to train on")
    device: Literal["auto", "cpu", "cuda"] = opt("auto", "where the one-device part runs")
    gpus: int = opt(0, "N >= 2: time TP against FSDP2 on N GPUs instead")
    record: bool = opt(False, f"write the results as records: {', '.join(ONE_GPU)} on one GPU, "
                       f"{RECORD} with --gpus")

    def __post_init__(self) -> None:
        check(*shape_rules(self.dim, self.heads, self.layers, self.seq),
              (all(b >= 1 for b in self.batches) and self.batches, "--batches: give sizes >= 1"),
              (self.repeats >= 1, f"--repeats must be >= 1, got {self.repeats}"),
              (self.train_steps >= 0 and self.train_batch >= 1,
               "--train-steps must be >= 0 and --train-batch >= 1"),
              (math.isfinite(self.lr) and self.lr > 0, f"--lr must be a number > 0, got {self.lr}"),
              (self.gpus == 0 or self.gpus >= 2, f"--gpus must be 0 or >= 2, got {self.gpus}"),
              (not self.record or self.device != "cpu",
               "--record measures a GPU: leave out --device cpu"))

    @property
    def model(self) -> GPTConfig:
        return GPTConfig(seq=self.seq, layers=self.layers, heads=self.heads, dim=self.dim)

    @property
    def torch_device(self) -> torch.device:
        cuda = self.device == "cuda" or (self.device == "auto" and torch.cuda.is_available())
        return torch.device("cuda" if cuda else "cpu")


def make_step(model: GPT, optimizer: torch.optim.Optimizer, device: torch.device):
    """One training step: bf16 autocast on a GPU (fp32 on the CPU), AdamW, clipped gradients."""
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
            loss = lm_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()
    return step


def build(cfg: GPTConfig, device: torch.device, activation_checkpointing: bool = False):
    torch.manual_seed(0)
    model = GPT(cfg, activation_checkpointing).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95),
                                  weight_decay=0.1, fused=device.type == "cuda")
    return model, optimizer


@dataclass
class StepRow:
    """The training step at one batch size: a row of ``07-gpt-steps``."""

    batch: int
    checkpointing: bool
    params: int
    step_ms: float | None = None
    tokens_per_s: float | None = None
    tflops: float | None = None  # model FLOPs per second (6 per parameter and token + attention)
    peak_gib: float | None = None  # None on the CPU
    oom: bool = False


@dataclass
class TrainingRun:
    """The short training run: a row of ``07-gpt-training``."""

    corpus: str
    points: list[dict]  # step, training-batch loss, held-out loss, seconds since the start
    seconds: float  # evaluations included
    tokens: int


def step_row(cfg: TransformerConfig, size: int, recompute: bool) -> StepRow:
    """Time, throughput and peak memory of the training step at ``size`` sequences."""
    device = cfg.torch_device
    model, optimizer = build(cfg.model, device, recompute)
    n_params = sum(p.numel() for p in model.parameters())
    x = torch.randint(0, 256, (size, cfg.seq), device=device)
    step = make_step(model, optimizer, device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    try:
        t = benchmark(lambda: step(x, x), warmup=3, repeats=cfg.repeats, device=device)
    except torch.OutOfMemoryError:
        return StepRow(size, recompute, n_params, oom=True)
    tokens_s = size * cfg.seq / (t.median_ms / 1e3)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return StepRow(size, recompute, n_params, t.median_ms, tokens_s,
                   mfu.gpt_step_flops(cfg.model, size, n_params) / t.median_ms / 1e9, peak)


def step_rows(cfg: TransformerConfig) -> list[StepRow]:
    rows = [step_row(cfg, size, recompute) for size in cfg.batches for recompute in (False, True)]
    if cfg.torch_device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


STEP_COLUMNS = (Column("batch", "batch", width=6), Column("ckpt", "  checkpointing", width=16,
                                                          left=True),
                Column("step_ms", "step ms", ".1f", 9), Column("tokens_per_s", "tokens/s", ",.0f",
                                                               11),
                Column("tflop", "TFLOP/step", ".2f", 11), Column("tflops", "TFLOP/s", ".0f", 9),
                mfu.COLUMN, Column("peak_gib", "peak GiB", ".2f", 10))


def step_table(rows: list[StepRow], cfg: GPTConfig, gpu: str | None = None) -> str:
    """One line per batch and checkpointing: the step, its model FLOPs (``cfg``'s GPT, 6 per
    parameter and token plus attention; recomputation not counted), their rate and its MFU on
    the GPU named ``gpu``; then what MFU divides by."""
    out = []
    for r in rows:
        flops = mfu.gpt_step_flops(cfg, r.batch, r.params)
        out.append(dataclasses.asdict(r) | {
            "ckpt": "  " + ("yes" if r.checkpointing else "no")
                    + ("  (out of memory)" if r.oom else ""),
            "tflop": flops / 1e12, "mfu": mfu.mfu(flops, r.step_ms, gpu)})
    return table(out, STEP_COLUMNS) + "\n" + mfu.note(
        gpu, "model FLOPs: 6 per parameter and token plus the attention scores, recomputation "
        "not counted")


def corpus(cfg: TransformerConfig) -> Corpus:
    return stdlib_corpus() if cfg.data == "stdlib" else synthetic_corpus()


def lr_at(step: int, total: int, peak: float) -> float:
    """Linear warm-up over the first 5 % of the steps, then a cosine down to a tenth."""
    warm = max(1, total // 20)
    if step < warm:
        return peak * (step + 1) / warm
    done = (step - warm) / max(1, total - warm)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done)))


@torch.no_grad()
def val_loss(model: GPT, text: Corpus, cfg: TransformerConfig, batches: int = 8) -> float:
    model.eval()
    g = torch.Generator().manual_seed(1)  # the same windows at every evaluation
    losses = [lm_loss(model(x), y).item() for x, y in
              (batch(text.val, cfg.train_batch, cfg.seq, g, cfg.torch_device)
               for _ in range(batches))]
    model.train()
    return sum(losses) / len(losses)


def train(cfg: TransformerConfig, text: Corpus | None = None) -> TrainingRun:
    """``train_steps`` steps on ``text`` (default: ``cfg.data``'s corpus): the training and
    validation loss at the first step and ten times on the way."""
    text, device = text or corpus(cfg), cfg.torch_device
    model, optimizer = build(cfg.model, device)
    step, g = make_step(model, optimizer, device), torch.Generator().manual_seed(0)
    points, every, t0 = [], max(1, cfg.train_steps // 10), time.perf_counter()
    for i in range(cfg.train_steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(i, cfg.train_steps, cfg.lr)
        loss = step(*batch(text.train, cfg.train_batch, cfg.seq, g, device))
        if (i + 1) % every == 0 or i == 0:
            points.append({"step": i + 1, "train": loss.item(), "val": val_loss(model, text, cfg),
                           "seconds": time.perf_counter() - t0})
    synchronize(device)
    return TrainingRun(text.name, points, time.perf_counter() - t0,
                       cfg.train_steps * cfg.train_batch * cfg.seq)


def loss_figure(run: TrainingRun, hardware: str):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    steps = [p["step"] for p in run.points]
    ax.plot(steps, [p["train"] for p in run.points], "o-", label="training batch")
    ax.plot(steps, [p["val"] for p in run.points], "s--", label="held-out text")
    ax.axhline(math.log(256), color="grey", lw=0.8, ls=":", label="ln 256: a uniform guess")
    ax.set(xlabel="step", ylabel="loss (nats per byte)",
           title=f"The GPT learns to predict Python source ({hardware})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def n_gpu_rows(cfg: TransformerConfig) -> list[dict]:
    """The worker's rows: each mode on ``cfg.gpus`` GPUs, the same model and global batch."""
    from .workers.tp_step import TPStepConfig

    worker = TPStepConfig(dim=cfg.dim, layers=cfg.layers, heads=cfg.heads, seq=cfg.seq,
                          batch=max(cfg.batches), repeats=cfg.repeats, device="cuda")
    return run_worker(WORKER, worker, nproc=cfg.gpus)


N_GPU_COLUMNS = (Column("mode", "mode", width=20, left=True), Column("mesh", "mesh", width=12,
                                                                     left=True),
                 Column("step_ms", "step ms", ".1f", 9),
                 Column("tokens_per_s", "tokens/s", ",.0f", 11),
                 Column("tflop", "TFLOP/step", ".2f", 11), mfu.COLUMN,
                 Column("peak_gib", "peak GiB", ".2f", 10))


def n_gpu_table(rows: list[dict], cfg: GPTConfig, gpu: str | None = None) -> str:
    """One line per mode: the step of ``cfg``'s GPT on the whole global batch, its model FLOPs,
    and its MFU on the ``world_size`` GPUs named ``gpu``; then what MFU divides by."""
    out = [r | {"tflop": (f := mfu.gpt_step_flops(cfg, r["batch"])) / 1e12,
                "mfu": mfu.mfu(f, r["step_ms"], gpu, r["world_size"])} for r in rows]
    return table(out, N_GPU_COLUMNS) + "\n" + mfu.note(
        gpu, "model FLOPs of the global batch: 6 per parameter and token plus the attention "
        "scores")


def link_bus_gbps() -> tuple[float, str]:
    """The all-reduce bus bandwidth chapter 4's record measured between two GPUs, and where."""
    record = records.load("04-data-parallel")
    rows = [r for r in (record.rows if record else []) if r.get("bus_gbps")]
    if not rows:
        raise FileNotFoundError("book/data/04-data-parallel.jsonl has no bus bandwidth; remake "
                                "it with `make records RECORDS=04`")
    stamp = record.header["stamp"]
    return rows[0]["bus_gbps"], (f"{record.hardware} ({stamp['interconnect']}), chapter 4's "
                                 f"record of {stamp['date_utc'].split()[0]}")


def where_tp_pays(dims, tps, flops_per_s: float, bus_gbps: float) -> list[dict]:
    """Per width and TP degree: all-reduce time over compute time, and the speed-up over one
    GPU that TP would reach if its compute split perfectly and nothing overlapped."""
    from ..parallel.tensor import tp_comm_over_compute

    rows = []
    for dim in dims:
        row = {"dim": dim}
        for n in tps:
            r = tp_comm_over_compute(dim, n, flops_per_s, bus_gbps)
            row |= {f"ratio_{n}": r, f"speedup_{n}": n / (1 + r)}
        rows.append(row)
    return rows


def pays_table(rows: list[dict], tps) -> str:
    cols = [Column("dim", "width", width=7)]
    for n in tps:
        cols += [Column(f"ratio_{n}", f"comm/comp N={n}", ".2f", 16),
                 Column(f"speedup_{n}", "speed-up", ".2f", 10, unit="x")]
    return table(rows, cols)


def n_gpu_measured(cfg: TransformerConfig) -> tuple[list[dict], records.Source]:
    """The N-GPU rows: the record's, this machine's with TUTORIAL_MEASURE=1, else none yet."""
    return records.measured(RECORD, lambda: n_gpu_rows(cfg), gpus=cfg.gpus, cfg=cfg,
                            compare=records.Compare(("mode", "mesh"), "step_ms", "step ms"))


def one_gpu(cfg: TransformerConfig) -> tuple[list[StepRow], TrainingRun, records.Source]:
    """The step rows and the training run on one GPU: the records', this GPU's with
    TUTORIAL_MEASURE=1, or, with neither, a small run on the CPU."""
    steps, source = records.measured(
        ONE_GPU[0], lambda: step_rows(cfg), gpus=1, cfg=cfg, row_type=StepRow,
        compare=records.Compare(("batch", "checkpointing"), "step_ms", "batch ckpt: step ms"),
        stand_in=lambda: step_rows(dataclasses.replace(cfg, device="cpu")),
        stand_in_where="this process")
    runs, _ = records.measured(
        ONE_GPU[1], lambda: [train(cfg)], gpus=1, cfg=cfg, row_type=TrainingRun,
        stand_in=lambda: [train(dataclasses.replace(cfg, device="cpu"))])
    return steps, runs[0], source


def check_lines(checks: dict[int, dict[str, dict]], mode: str) -> list[str]:
    """Chapter 7's report of ``mode`` on each count of processes: how far from one process."""
    return [f"{mode} on {n} ranks: loss differs by {r['loss_diff']:.1e}, gradients by at most "
            f"{r['grad_diff']:.1e};\n  a rank holds {r['params_per_rank']:,} of "
            f"{r['params_total']:,} parameter values"
            for n, rows in checks.items() if (r := rows.get(mode))]


def layout_lines(row: dict) -> list[str]:
    """A few parameters of one check's rank 0: whole shape, its slice, and placements."""
    out = []
    for name, p in row["layout"].items():
        where = (" ".join(p["placements"]) if p["placements"] else
                 "plain tensor" + (", whole" if p["local"] == p["shape"] else ", a slice"))
        out.append(f"  {name:<24} whole {str(tuple(p['shape'])):<10} this rank "
                   f"{str(tuple(p['local'])):<10} {where}")
    return out


def summary(steps: list[StepRow], run: TrainingRun, gpu: str | None = None) -> dict:
    """Chapter 7's glue: the largest batch's rows with and without checkpointing (their MFU in
    %, on the GPU named ``gpu``: NaN where unknown), the run."""
    size = max(r.batch for r in steps)
    plain, ckpt = (next(r for r in steps if r.batch == size and r.checkpointing == c)
                   for c in (False, True))
    nan = float("nan")  # a row that ran out of memory, or no peak on the CPU
    out = {"batch": size, "params_m": plain.params / 1e6, "step_ms": plain.step_ms,
           "tflops": plain.tflops, "tokens_per_s": plain.tokens_per_s,
           "ckpt_slowdown": ckpt.step_ms / plain.step_ms if plain.step_ms and ckpt.step_ms
           else nan,
           "peak_plain": plain.peak_gib or nan, "peak_ckpt": ckpt.peak_gib or nan,
           "mfu": mfu.percent(mfu.of_rate((plain.tflops or nan) * 1e12, gpu)),
           "mfu_gpu": mfu.short_name(gpu),
           "mfu_ckpt": mfu.percent(mfu.of_rate((ckpt.tflops or nan) * 1e12, gpu))}
    first, last = run.points[0], run.points[-1]
    return out | {"loss_first": first["train"], "val_last": last["val"],
                  "train_s": run.seconds, "train_tokens_m": run.tokens / 1e6}


def _enough_gpus(cfg: TransformerConfig) -> None:
    if cfg.gpus:  # N GPUs, one process each: never CPU processes that pass for them
        check_gpus(cfg.gpus, "--gpus", "--gpus 0 for the one-device part", fewest=2)
    elif cfg.record and not torch.cuda.is_available():
        raise ConfigError("--record measures the GPT on one GPU, and this machine has none; "
                          "leave out --record to measure the CPU")


def main(argv: list[str] | None = None) -> None:
    cfg = parse_or_exit(TransformerConfig, argv, __spec__.name, machine=_enough_gpus)
    if cfg.gpus:
        rows = n_gpu_rows(cfg)
        print(n_gpu_table(rows, cfg.model, mfu.this_gpu()))
        if cfg.record:
            path = records.write(RECORD, cfg, rows, __spec__.name, [WORKER], gpus=cfg.gpus,
                                 what=WHAT[RECORD])
            print(f"wrote {path}")
        return
    steps = step_rows(cfg)
    on_gpu = cfg.torch_device.type == "cuda"
    print(step_table(steps, cfg.model, mfu.this_gpu() if on_gpu else None))
    run = train(cfg) if cfg.train_steps else None
    if run:
        print(f"{run.corpus}: loss {run.points[0]['train']:.2f} -> "
              f"{run.points[-1]['val']:.2f} (held out) in {run.seconds:.0f} s")
    if cfg.record:
        for name, rows in zip(ONE_GPU, (steps, [run] if run else []), strict=True):
            path = records.write(name, cfg, rows, __spec__.name, gpus=1, what=WHAT[name])
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
