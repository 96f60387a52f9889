"""Train the Wide-ResNet on CIFAR-10 or the GPT on text: one entry point for the CPU, one GPU,
or N under torchrun, with DDP, FSDP2, HSDP or (the GPT) FSDP2 x tensor parallelism.

    python -m tutorial_utils.train --epochs 10 --data cifar10-jpeg.tar.gz
    torchrun --standalone --nproc_per_node=2 -m tutorial_utils.train --epochs 10 ...
    torchrun --standalone --nproc_per_node=4 -m tutorial_utils.train --model gpt \\
        --strategy fsdp2 --tp 2 --batch 32 --schedule cosine --clip-norm 1.0 ...

Rank 0 writes one JSON line per epoch to ``<out>/metrics.jsonl`` (after a first line with the
configuration and the environment stamp). Under DDP rank 0 writes a checkpoint to
``<out>/checkpoint.pt``; under fsdp2 and hsdp every rank writes its shards to
``<out>/checkpoints/step-N`` with DCP, in the background, and any number of processes can
resume them.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path

import torch

from .checkpoint import CheckpointError
from .config import ConfigError, parse, to_dict
from .data import Cifar10, DataError, load_cifar10
from .devices import NotEnoughGPUsError
from .gpt_trainer import GPTTrainer
from .jsonl import read_jsonl, rewrite_jsonl, write_jsonl
from .parallel.distributed import DistContext, distributed
from .parallel.strategy import check_layout
from .text import Corpus, stdlib_corpus, synthetic_corpus
from .trainer import Diverged, TrainConfig, Trainer


def load_text(cfg: TrainConfig) -> Corpus:
    """The GPT's text: the standard library's source (--data auto), or random bytes."""
    if cfg.data == "synthetic":
        return synthetic_corpus(seed=cfg.seed)
    try:
        return stdlib_corpus()
    except FileNotFoundError as err:
        raise DataError(f"--data auto: {err}") from None


def make_trainer(cfg: TrainConfig, ctx: DistContext,
                 data: Cifar10 | Corpus) -> Trainer | GPTTrainer:
    """The trainer of ``cfg.model``."""
    return (GPTTrainer if cfg.model == "gpt" else Trainer)(cfg, ctx, data)


def _load_data(cfg: TrainConfig, ctx: DistContext) -> Cifar10 | Corpus:
    if cfg.model == "gpt":
        return load_text(cfg)
    if ctx.is_main:  # decode/download once; the others then read the cache
        data = load_cifar10(cfg.data, limit_per_class=cfg.limit_per_class)
    ctx.barrier()
    return data if ctx.is_main else load_cifar10(cfg.data, limit_per_class=cfg.limit_per_class)


def _set_up_kernels(cfg: TrainConfig, ctx: DistContext) -> None:
    if ctx.device.type == "cuda":
        # Fixed shapes: let cuDNN time its kernels once and keep the fastest, unless the run
        # must repeat exactly (the fastest kernels may sum in a different order each time).
        torch.backends.cudnn.benchmark = not cfg.deterministic
        torch.backends.cuda.matmul.allow_tf32 = True
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts
        torch.use_deterministic_algorithms(True, warn_only=True)


def cpu_runs_bf16() -> bool:
    """Whether this CPU has bf16 instructions (AVX512-BF16 or AMX); without them bf16
    arithmetic is emulated."""
    return any(getattr(torch.cpu, probe, lambda: False)()
               for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


def precision_here(cfg: TrainConfig, device: torch.device) -> TrainConfig:
    """``cfg`` with the precision this device can run: on a CPU without bf16 instructions, bf16
    autocast is emulated and several times slower than fp32, so such a run is fp32 (and its
    start record says so)."""
    if device.type == "cpu" and cfg.precision == "bf16" and not cpu_runs_bf16():
        return dataclasses.replace(cfg, precision="fp32")
    return cfg


def run(cfg: TrainConfig, ctx: DistContext) -> list[dict]:
    """Train; return the per-epoch records (rank 0 also writes them to metrics.jsonl)."""
    asked, cfg = cfg, precision_here(cfg, ctx.device)
    _set_up_kernels(cfg, ctx)
    data = _load_data(cfg, ctx)
    trainer = make_trainer(cfg, ctx, data)
    if cfg.resume and trainer.has_checkpoint():
        trainer.restore()
    elif cfg.resume and ctx.is_main:  # a first attempt, or a mistyped --out: say which it is
        print(f"--resume: no {trainer.checkpoint_path} yet; training from epoch 1",
              file=sys.stderr)
    if cfg.precision != asked.precision and ctx.is_main:  # said once the run is sure to start
        print(f"--precision {asked.precision}: this CPU has no bf16 instructions (AVX512-BF16, "
              f"AMX) and would emulate them; training in {cfg.precision}", file=sys.stderr)
    with trainer.graph:  # a recorded graph is released before the process group goes
        records = _train(cfg, ctx, data, trainer)
    trainer.close()  # a sharded save still being written: finished and committed
    return records


def _start_record(cfg: TrainConfig, ctx: DistContext, data: Cifar10 | Corpus,
                  trainer: Trainer | GPTTrainer, warmup_s: float) -> dict:
    from .stamp import environment_stamp

    mesh = trainer.mesh
    record = {"event": "start", "config": to_dict(cfg), "data": data.name,
              "synthetic_data": data.name.startswith("synthetic"), "world_size": ctx.world_size,
              "per_gpu_batch": trainer.per_gpu, "global_batch": trainer.global_batch,
              "peak_lr": cfg.peak_lr(trainer.data_world), "start_epoch": trainer.start_epoch,
              "compile_warmup_s": warmup_s, "stamp": environment_stamp().as_dict()}
    if cfg.model != "wrn" or cfg.strategy != "ddp":  # DDP's Wide-ResNet records as before
        record["mesh"] = dict(zip(mesh.mesh_dim_names, mesh.shape, strict=True)) if mesh else None
    return record


def _keep_records_until(metrics: Path, epoch: int) -> float:
    """Before a resume from the checkpoint of ``epoch``: drop the records of later epochs (an
    attempt may have logged an epoch and died before checkpointing it); return the training
    time so far, so that time to accuracy adds up over the attempts."""
    kept = [r for r in read_jsonl(metrics) if r["event"] != "epoch" or r["epoch"] <= epoch]
    rewrite_jsonl(metrics, kept)
    return next((r["train_time_s"] for r in reversed(kept) if r["event"] == "epoch"), 0.0)


def _metrics_line(cfg: TrainConfig, record: dict) -> str:
    """What rank 0 prints of an epoch's record."""
    epoch = f"epoch {record['epoch']:3d}/{cfg.epochs}  {record['epoch_time_s']:6.2f} s  "
    if cfg.model == "gpt":
        line = (f"{epoch}{record['tokens_per_s']:9.0f} tok/s  loss {record['train_loss']:.3f}  "
                f"val {record['val_loss']:.3f}")
    else:
        line = (f"{epoch}{record['images_per_s']:8.0f} img/s  loss {record['train_loss']:.3f}  "
                f"train {record['train_acc']:.2%}  test {record['test_acc']:.2%}")
    if "save_stall_s" in record:  # what the asynchronous save held the loop, against a step
        line += (f"  save {record['save_stall_s'] * 1e3:.1f} ms held "
                 f"(a step {record['step_s'] * 1e3:.1f} ms)")
    return line


def _train(cfg: TrainConfig, ctx: DistContext, data: Cifar10 | Corpus,
           trainer: Trainer | GPTTrainer) -> list[dict]:
    warmup_s = trainer.warm_up() if cfg.compile != "none" or cfg.step_graph else 0.0
    metrics, train_s = cfg.out / "metrics.jsonl", 0.0
    if ctx.is_main:
        if trainer.start_epoch == 0:
            metrics.unlink(missing_ok=True)
        else:
            train_s = _keep_records_until(metrics, trainer.start_epoch)
        write_jsonl(metrics, [_start_record(cfg, ctx, data, trainer, warmup_s)])
        if data.name.startswith("synthetic"):
            real = "the standard library's source" if cfg.model == "gpt" else "CIFAR-10"
            print(f"WARNING: training on {data.name} data, not {real}", file=sys.stderr)
    records, t0 = [], time.perf_counter()  # the clock starts after compilation
    score = "val_loss" if cfg.model == "gpt" else "test_acc"
    for epoch in range(trainer.start_epoch, cfg.epochs):
        record = {"event": "epoch", "epoch": epoch + 1, **trainer.train_one_epoch(epoch),
                  score: trainer.evaluate(), "lr": trainer.scheduler.get_last_lr()[0]}
        train_s += record["epoch_time_s"]
        # time to accuracy: training alone (all attempts), the wall clock with evaluation (this
        # attempt; rank 0's sums are the ones written)
        record |= {"train_time_s": train_s, "wall_s": time.perf_counter() - t0}
        last = epoch + 1 == cfg.epochs
        due = cfg.checkpoint_every and ((epoch + 1) % cfg.checkpoint_every == 0 or last)
        if due and cfg.sharded:  # asynchronous: its record says what it held the loop
            record |= {**trainer.save(epoch), "step_s": record["epoch_time_s"]
                       / trainer.steps_per_epoch}
        records.append(record)
        if ctx.is_main:
            write_jsonl(metrics, [record])
            print(_metrics_line(cfg, record), flush=True)
        if due and not cfg.sharded:
            trainer.save(epoch)  # every rank takes part: their random states are gathered
        ctx.barrier()  # nobody runs ahead while rank 0 writes the checkpoint
    return records


def main(argv: list[str] | None = None) -> int:
    prog = "python -m tutorial_utils.train"
    try:
        cfg = parse(TrainConfig, argv, prog)
        with distributed(cfg.device) as ctx:
            # fail before loading anything
            check_layout(cfg.strategy, ctx.world_size, cfg.shard_size, cfg.tp)
            cfg.batches(cfg.data_parallel(ctx.world_size))
            run(cfg, ctx)
    except (ConfigError, DataError, CheckpointError, NotEnoughGPUsError, Diverged) as err:
        # Every rank says its own error: one rank alone may hit it (a checkpoint without its
        # random state, a file only its node cannot read), and whichever rank torchrun sees
        # fail first is the one whose message the launcher's summary shows.
        rank, world = os.environ.get("RANK", "0"), int(os.environ.get("WORLD_SIZE", "1"))
        who = f"rank {rank}: " if world > 1 and rank != "0" else ""
        print(f"{prog}: error: {who}{err}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
