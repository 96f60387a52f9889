"""Train a Wide-ResNet on CIFAR-10: one entry point for the CPU, one GPU, or N under torchrun.

    python -m tutorial_utils.train --epochs 10 --data cifar10-jpeg.tar.gz
    torchrun --standalone --nproc_per_node=2 -m tutorial_utils.train --epochs 10 ...

Rank 0 writes one JSON line per epoch to ``<out>/metrics.jsonl`` (after a first line with the
configuration and the environment stamp) and a checkpoint to ``<out>/checkpoint.pt``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from .checkpoint import CheckpointError
from .config import ConfigError, parse, to_argv, to_dict
from .data import Cifar10, DataError, load_cifar10
from .devices import NotEnoughGPUsError
from .launch import read_metrics
from .parallel.distributed import DistContext, distributed
from .report import write_jsonl
from .trainer import Trainer

REFERENCE_BATCH = 128  # the batch the base learning rate is given for


def opt(default, doc: str):
    """A config field with its ``--help`` text."""
    return field(default=default, metadata={"help": doc})


@dataclass
class TrainConfig:
    depth: int = opt(28, "WRN depth, 6n+4")
    width: int = opt(10, "WRN width factor k")
    dropout: float = opt(0.0, "dropout between the convolutions of a block (the paper: 0.3)")
    epochs: int = opt(10, "epochs to train")
    batch: int = opt(128, "global batch (strong scaling) or per-GPU batch (weak scaling)")
    scaling: Literal["strong", "weak"] = opt("strong", "how --batch is shared by the processes")
    lr: float = opt(0.1, f"learning rate at a global batch of {REFERENCE_BATCH}, scaled linearly")
    schedule: Literal["warmup-linear", "step"] = opt(
        "warmup-linear", "after the warm-up: linear decay to 0, or the paper's x0.2 at 30/60/80 "
        "%% of the epochs")
    warmup_epochs: float = opt(1.0, "linear warm-up from 0 to the peak learning rate")
    weight_decay: float = opt(5e-4, "L2 weight decay (SGD with Nesterov momentum 0.9)")
    label_smoothing: float = opt(0.0, "label smoothing of the cross-entropy loss")
    crop_pad: int = opt(4, "augmentation: random crops from images padded by this many "
                        "pixels, plus random mirroring (0: mirroring only)")
    tta: bool = opt(False, "test-time augmentation: sum the outputs for each test image and "
                    "its mirror image")
    bf16: bool = opt(True, "bf16 autocast")
    compile: Literal["none", "default", "reduce-overhead"] = opt("none", "torch.compile mode")
    step_graph: bool = opt(False, "record forward and backward, all-reduces included, as one "
                           "CUDA graph replayed every step; with --compile default or none")
    loader: Literal["device", "dataloader"] = opt(
        "device", "device: data kept on the GPU, augmented there; dataloader: CPU workers")
    data: str = opt("auto", "auto (./data, downloaded when online), synthetic, a "
                    "torchvision-layout folder, or an image-folder tree / tarball")
    limit_per_class: int | None = opt(None, "use only N training images per class")
    device: Literal["auto", "cpu", "cuda"] = opt("auto", "cuda needs one GPU per process")
    out: Path = opt(Path("runs/wrn"), "output folder: metrics.jsonl, checkpoint.pt")
    checkpoint_every: int = opt(1, "epochs between checkpoints (0: never)")
    resume: bool = opt(False, "continue from <out>/checkpoint.pt")
    seed: int = opt(0, "seed for initialisation, data order and augmentation")
    deterministic: bool = opt(
        False, "deterministic kernels (no cuDNN autotuning): runs repeat bit for bit, slower")

    def __post_init__(self) -> None:
        if self.depth < 10 or (self.depth - 4) % 6:
            raise ConfigError(f"--depth must be 6n+4 (10, 16, 22, 28, 40, ...), got {self.depth}")
        checks = [
            (self.width >= 1, f"--width must be >= 1, got {self.width}"),
            (0 <= self.dropout < 1, f"--dropout must be in [0, 1), got {self.dropout}"),
            (self.epochs >= 1, f"--epochs must be >= 1, got {self.epochs}"),
            (self.batch >= 1, f"--batch must be >= 1, got {self.batch}"),
            (self.lr > 0, f"--lr must be > 0, got {self.lr}"),
            (0 <= self.warmup_epochs <= self.epochs,
             f"--warmup-epochs must be in [0, --epochs], got {self.warmup_epochs}"),
            (self.checkpoint_every >= 0, "--checkpoint-every must be >= 0"),
            (self.crop_pad >= 0, f"--crop-pad must be >= 0, got {self.crop_pad}"),
            (not (self.step_graph and self.compile == "reduce-overhead"),
             "--step-graph records the whole step itself: use it with --compile default or "
             "none, not reduce-overhead"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)

    def batches(self, world_size: int) -> tuple[int, int]:
        """(per-process batch, global batch) for ``world_size`` processes."""
        if self.scaling == "strong" and self.batch % world_size:
            raise ConfigError(f"global --batch {self.batch} is not divisible by {world_size} "
                              f"processes; use a multiple of {world_size}, or --scaling weak")
        per_gpu = self.batch if self.scaling == "weak" else self.batch // world_size
        return per_gpu, per_gpu * world_size

    def peak_lr(self, world_size: int) -> float:
        """The linear scaling rule (Goyal et al.): the rate grows with the global batch."""
        return self.lr * self.batches(world_size)[1] / REFERENCE_BATCH

    def to_argv(self) -> list[str]:
        """The command-line options that give this configuration (the non-default ones)."""
        return to_argv(self)


def _load_data(cfg: TrainConfig, ctx: DistContext) -> Cifar10:
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


def run(cfg: TrainConfig, ctx: DistContext) -> list[dict]:
    """Train; return the per-epoch records (rank 0 also writes them to metrics.jsonl)."""
    _set_up_kernels(cfg, ctx)
    data = _load_data(cfg, ctx)
    trainer = Trainer(cfg, ctx, data)
    if cfg.resume and trainer.checkpoint_path.exists():
        trainer.restore()
    with trainer.graph:  # a recorded graph is released before the process group goes
        return _train(cfg, ctx, data, trainer)


def _start_record(cfg: TrainConfig, ctx: DistContext, data: Cifar10, trainer: Trainer,
                  warmup_s: float) -> dict:
    from .stamp import environment_stamp

    return {"event": "start", "config": to_dict(cfg), "data": data.name,
            "synthetic_data": data.synthetic, "world_size": ctx.world_size,
            "per_gpu_batch": trainer.per_gpu, "global_batch": trainer.global_batch,
            "peak_lr": cfg.peak_lr(ctx.world_size), "start_epoch": trainer.start_epoch,
            "compile_warmup_s": warmup_s, "stamp": environment_stamp().as_dict()}


def _keep_records_until(metrics: Path, epoch: int) -> float:
    """Before a resume from the checkpoint of ``epoch``: drop the records of later epochs (an
    attempt may have logged an epoch and died before checkpointing it); return the training
    time so far, so that time to accuracy adds up over the attempts."""
    kept = [r for r in read_metrics(metrics) if r["event"] != "epoch" or r["epoch"] <= epoch]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in kept))
    return next((r["train_time_s"] for r in reversed(kept) if r["event"] == "epoch"), 0.0)


def _train(cfg: TrainConfig, ctx: DistContext, data: Cifar10, trainer: Trainer) -> list[dict]:
    warmup_s = trainer.warm_up() if cfg.compile != "none" or cfg.step_graph else 0.0
    metrics, train_s = cfg.out / "metrics.jsonl", 0.0
    if ctx.is_main:
        if trainer.start_epoch == 0:
            metrics.unlink(missing_ok=True)
        else:
            train_s = _keep_records_until(metrics, trainer.start_epoch)
        write_jsonl(metrics, [_start_record(cfg, ctx, data, trainer, warmup_s)])
        if data.synthetic:
            print(f"WARNING: training on {data.name} data, not CIFAR-10", file=sys.stderr)
    records, t0 = [], time.perf_counter()  # the clock starts after compilation
    for epoch in range(trainer.start_epoch, cfg.epochs):
        record = {"event": "epoch", "epoch": epoch + 1, **trainer.train_one_epoch(epoch),
                  "test_acc": trainer.evaluate(), "lr": trainer.scheduler.get_last_lr()[0]}
        train_s += record["epoch_time_s"]
        # time to accuracy: training alone (all attempts), the wall clock with evaluation (this
        # attempt; rank 0's sums are the ones written)
        record |= {"train_time_s": train_s, "wall_s": time.perf_counter() - t0}
        records.append(record)
        if ctx.is_main:
            write_jsonl(metrics, [record])
            print(f"epoch {epoch + 1:3d}/{cfg.epochs}  {record['epoch_time_s']:6.2f} s  "
                  f"{record['images_per_s']:8.0f} img/s  loss {record['train_loss']:.3f}  "
                  f"train {record['train_acc']:.2%}  test {record['test_acc']:.2%}", flush=True)
        last = epoch + 1 == cfg.epochs
        if cfg.checkpoint_every and ((epoch + 1) % cfg.checkpoint_every == 0 or last):
            trainer.save(epoch)  # every rank takes part: their random states are gathered
        ctx.barrier()  # nobody runs ahead while rank 0 writes the checkpoint
    return records


def main(argv: list[str] | None = None) -> int:
    prog = "python -m tutorial_utils.train"
    try:
        cfg = parse(TrainConfig, argv, prog, __doc__.splitlines()[0])
        with distributed(cfg.device) as ctx:
            cfg.batches(ctx.world_size)  # fail before loading anything
            run(cfg, ctx)
    except (ConfigError, DataError, CheckpointError, NotEnoughGPUsError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
