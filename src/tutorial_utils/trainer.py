"""One training run's pieces: model, data, optimizer and schedule, and one epoch of each phase.

:mod:`tutorial_utils.train` builds a :class:`Trainer` (the Wide-ResNet on CIFAR-10) or a
:class:`~tutorial_utils.gpt_trainer.GPTTrainer` (the GPT on text) from its
:class:`TrainConfig` and drives it. The configuration lives beside the trainers it configures,
each setting saying what a resume does with it. The parts a reader copies into their own loop
are here, each short: the learning-rate schedule, the network wrapped for its strategy (DDP,
optionally compiled or graphed; FSDP2 or HSDP from :mod:`tutorial_utils.parallel.strategy`),
the epoch loop, checkpoint save and restore (one file under DDP; DCP's sharded folders, saved
asynchronously, under the sharded strategies), and evaluation. The step they run is
:mod:`tutorial_utils.step`'s.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import os
import random
import signal
import sys
import time
from dataclasses import MISSING, dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from . import checkpoint as ckpt
from .config import Config, ConfigError, check, opt, to_dict
from .data import Cifar10
from .loaders import DeviceLoader, dataloader, normalize
from .models.ghost_bn import ghost_batchnorm
from .models.gpt import GPTConfig, shape_rules
from .models.wrn import WideResNet
from .parallel.ddp import compile_for_ddp, ddp
from .parallel.distributed import DistContext, all_reduce_sum
from .parallel.strategy import (
    SHARDED,
    broadcast_buffers,
    build_mesh,
    clip_gradients,
    precision_policy,
    wrap_wrn,
)
from .sharded_checkpoint import AsyncCheckpointer, latest_checkpoint, load_sharded, verify
from .step import AUTOCAST, accumulate, predict
from .step_graph import StepGraph
from .timing import synchronize

CRASH_ENV = "TUTORIAL_CRASH_AT_STEP"  # fault injection for chapter 6's demo, not a setting
# The save of this epoch (counted from 1) is killed while DCP writes it: fault injection for the
# tests, not a setting. The last rank kills itself once async_save has returned.
SAVE_CRASH_ENV = "TUTORIAL_CRASH_IN_SAVE"

# --- The run's configuration, and what a resume does with each setting ------------------------

REFERENCE_BATCH = 128  # the batch the base learning rate is given for
WRN_LR = 0.1  # --lr's default: the Wide-ResNet's SGD rate at REFERENCE_BATCH
VOCAB = GPTConfig.vocab  # the GPT reads bytes


def must_match(default: Any, doc: str, older: Any = MISSING) -> Any:
    """A setting of what the run trains: the model, the data and its order, the optimisation and
    its numerics. A resume must use the checkpoint's value (:meth:`Trainer.restore` checks).

    ``older``, for an option added after runs were recorded: the value those runs trained with.
    """
    return opt(default, doc, resume="must match", **_older(older))


def may_change(default: Any, doc: str, older: Any = MISSING) -> Any:
    """A setting of how the run executes, not of what it trains: a resume may change it, and
    each attempt's start record in metrics.jsonl says what it used."""
    return opt(default, doc, resume="may change", **_older(older))


def _older(value: Any) -> dict[str, Any]:
    return {} if value is MISSING else {"older": value}


@dataclass
class TrainConfig(Config):
    """Train the Wide-ResNet on CIFAR-10 or the GPT on text: one process, or N under torchrun,
    with DDP, FSDP2, HSDP or (the GPT) FSDP2 x tensor parallelism."""

    model: Literal["wrn", "gpt"] = must_match(
        "wrn", "the network: the Wide-ResNet on CIFAR-10, or the GPT of chapter 7 on text",
        older="wrn")
    strategy: Literal["ddp", "fsdp2", "hsdp"] = must_match(
        "ddp", "ddp: a replica per process, gradients all-reduced; fsdp2: parameters, gradients "
        "and optimizer state sharded over every process (fully_shard); hsdp: sharded within "
        "groups of --shard-size processes, replicated across them. fsdp2 and hsdp save DCP "
        "checkpoints, asynchronously, that any number of processes can resume", older="ddp")
    shard_size: int | None = may_change(
        None, "--strategy hsdp: processes per shard group, the mesh's shard dimension; it must "
        "divide the number of processes (default: the processes of one node)")
    tp: int = may_change(
        1, "--model gpt --strategy fsdp2: tensor parallelism over groups of N processes, FSDP2 "
        "across the groups (a 2-D mesh); N divides the processes and the attention heads")
    reshard_after_forward: bool = may_change(
        True, "fsdp2, hsdp: free each unit's gathered parameters after its forward and gather "
        "them again for backward (ZeRO-3); --no-reshard-after-forward keeps them (more memory, "
        "one all-gather less)")
    async_save: bool = may_change(
        True, "fsdp2, hsdp: save with DCP's async_save, the step waiting only for the copy to "
        "host memory; --no-async-save writes the checkpoint before training goes on")
    depth: int = must_match(28, "WRN depth, 6n+4")
    width: int = must_match(10, "WRN width factor k")
    dropout: float = must_match(
        0.0, "dropout between the convolutions of a block (the paper: 0.3)")
    epochs: int = must_match(10, "epochs to train")
    batch: int = must_match(
        128, "global batch (strong scaling) or per-GPU batch (weak scaling)")
    scaling: Literal["strong", "weak"] = must_match(
        "strong", "how --batch is shared by the processes")
    lr: float = must_match(
        WRN_LR, f"learning rate at a global batch of {REFERENCE_BATCH}, scaled linearly (the "
        "Wide-ResNet's SGD; the GPT's is --gpt-lr)")
    schedule: Literal["warmup-linear", "step", "cosine"] = must_match(
        "warmup-linear", "after the warm-up: linear decay to 0, the paper's x0.2 at 30/60/80 "
        "%% of the epochs, or a cosine down to a tenth (chapter 7's GPT)")
    warmup_epochs: float = must_match(1.0, "linear warm-up from 0 to the peak learning rate")
    weight_decay: float = must_match(5e-4, "L2 weight decay (SGD with Nesterov momentum 0.9); "
                                     "the GPT's AdamW decouples it (chapter 7: 0.1)")
    label_smoothing: float = must_match(0.0, "label smoothing of the cross-entropy loss")
    crop_pad: int = must_match(4, "augmentation: random crops from images padded by this many "
                               "pixels, plus random mirroring (0: mirroring only)")
    tta: bool = may_change(False, "test-time augmentation: sum the outputs for each test image "
                           "and its mirror image")
    precision: Literal["bf16", "fp16", "fp32"] = must_match(
        "bf16", "bf16 autocast; fp16 autocast with a gradient scaler, for GPUs without bf16; "
        "or fp32 throughout")
    grad_accum: int = must_match(1, "compute each process's batch as K micro-batches, "
                                 "all-reduced once (DDP's no_sync): less activation memory, "
                                 "the same step", older=1)
    clip_norm: float | None = must_match(None, "clip the gradients to this global L2 norm, "
                                         "after the all-reduce (the same on every rank)",
                                         older=None)
    sync_bn: bool = must_match(False, "SyncBatchNorm: BatchNorm statistics over every "
                               "process's batch, not each process's own", older=False)
    ghost_bn: int | None = must_match(None, "BatchNorm statistics over groups of this many "
                                      "images of each batch: what that many images per GPU "
                                      "give without --sync-bn, shown on one GPU", older=None)
    compile: Literal["none", "default", "reduce-overhead"] = may_change(
        "none", "torch.compile mode")
    step_graph: bool = may_change(False, "record forward and backward, all-reduces included, as "
                                  "one CUDA graph replayed every step; with --compile default "
                                  "or none")
    loader: Literal["device", "dataloader"] = must_match(
        "device", "device: data kept on the GPU, augmented there; dataloader: CPU workers")
    dim: int = must_match(384, "--model gpt: the model's width", older=384)
    layers: int = must_match(6, "--model gpt: transformer blocks", older=6)
    heads: int = must_match(6, "--model gpt: attention heads", older=6)
    seq: int = must_match(256, "--model gpt: bytes per sequence", older=256)
    epoch_steps: int = must_match(
        100, "--model gpt: optimizer steps per epoch (each a batch of random windows of the "
        "text, the same whatever the number of processes)", older=100)
    gpt_lr: float = must_match(
        1e-3, "--model gpt: AdamW's peak learning rate (betas 0.9, 0.95), not scaled with the "
        "batch", older=1e-3)
    # A resume may find its data elsewhere; Trainer.restore checks a fingerprint of the set.
    data: str = may_change("auto", "auto (./data, downloaded when online), synthetic, a "
                           "torchvision-layout folder, or an image-folder tree / tarball; "
                           "--model gpt: auto (the Python standard library's source) or "
                           "synthetic (random bytes)")
    limit_per_class: int | None = may_change(None, "use only N training images per class")
    device: Literal["auto", "cpu", "cuda"] = may_change("auto", "cuda needs one GPU per process")
    out: Path = may_change(Path("runs/wrn"), "output folder: metrics.jsonl, checkpoint.pt "
                           "(DDP) or checkpoints/step-N (fsdp2, hsdp)")
    checkpoint_every: int = may_change(1, "epochs between checkpoints (0: never)")
    resume: bool = may_change(False, "continue from the checkpoint in --out")
    seed: int = must_match(0, "seed for initialisation, data order and augmentation")
    deterministic: bool = may_change(
        False, "deterministic kernels (no cuDNN autotuning): runs repeat bit for bit, slower")

    def __post_init__(self) -> None:
        if self.depth < 10 or (self.depth - 4) % 6:
            raise ConfigError(f"--depth must be 6n+4 (10, 16, 22, 28, 40, ...), got {self.depth}")
        check(
            (self.width >= 1, f"--width must be >= 1, got {self.width}"),
            (0 <= self.dropout < 1, f"--dropout must be in [0, 1), got {self.dropout}"),
            (self.epochs >= 1, f"--epochs must be >= 1, got {self.epochs}"),
            (self.batch >= 1, f"--batch must be >= 1, got {self.batch}"),
            (math.isfinite(self.lr) and self.lr > 0, f"--lr must be a number > 0, got {self.lr}"),
            (math.isfinite(self.weight_decay) and self.weight_decay >= 0,
             f"--weight-decay must be a number >= 0, got {self.weight_decay}"),
            (0 <= self.label_smoothing < 1,
             f"--label-smoothing must be in [0, 1), got {self.label_smoothing}"),
            (self.limit_per_class is None or self.limit_per_class >= 1,
             f"--limit-per-class must be >= 1, got {self.limit_per_class}"),
            (0 <= self.warmup_epochs <= self.epochs,
             f"--warmup-epochs must be in [0, --epochs], got {self.warmup_epochs}"),
            (self.checkpoint_every >= 0, "--checkpoint-every must be >= 0"),
            (self.crop_pad >= 0, f"--crop-pad must be >= 0, got {self.crop_pad}"),
            # the loaders derive their generators' seeds from it: beyond this, past 2**64
            (abs(self.seed) < 2**40, f"--seed must be between -2**40 and 2**40, got {self.seed}"),
            (not Path(self.out).exists() or Path(self.out).is_dir(),
             f"--out {self.out} is a file; name a folder for metrics.jsonl and checkpoint.pt"),
            (self.grad_accum >= 1, f"--grad-accum must be >= 1, got {self.grad_accum}"),
            (self.clip_norm is None or (math.isfinite(self.clip_norm) and self.clip_norm > 0),
             f"--clip-norm must be a number > 0, got {self.clip_norm}"),
            (self.ghost_bn is None or self.ghost_bn >= 2,
             f"--ghost-bn must be >= 2 (a variance needs two images), got {self.ghost_bn}"),
            (not (self.ghost_bn and self.sync_bn),
             "--ghost-bn and --sync-bn ask for opposite statistics (fewer images, more): "
             "choose one"),
            (not (self.step_graph and self.precision == "fp16"),
             "--step-graph cannot record fp16's gradient scaler, which reads the gradients on "
             "the host: use --precision bf16 or fp32 with it"),
            (not (self.step_graph and self.grad_accum > 1),
             "--step-graph records one forward and backward per step: use it with "
             "--grad-accum 1"),
            (not (self.step_graph and self.compile == "reduce-overhead"),
             "--step-graph records the whole step itself: use it with --compile default or "
             "none, not reduce-overhead"),
        )
        self._check_strategy()
        if self.model == "gpt":
            self._check_gpt()

    def _check_strategy(self) -> None:
        sharded = self.strategy != "ddp"
        check(
            (self.tp >= 1, f"--tp must be >= 1, got {self.tp}"),
            (self.tp == 1 or self.model == "gpt",
             "--tp splits the GPT's attention heads and MLP over processes; the Wide-ResNet has "
             "no tensor-parallel plan: leave --tp out, or use --model gpt"),
            (self.tp == 1 or self.strategy == "fsdp2",
             f"--tp {self.tp} builds a 2-D mesh, FSDP2 x tensor parallel: use it with "
             "--strategy fsdp2"),
            (self.tp < 1 or self.heads % self.tp == 0,
             f"--tp {self.tp} must divide the {self.heads} attention heads (each process "
             f"computes whole heads); use a --tp that divides {self.heads}"),
            (self.tp < 1 or VOCAB % self.tp == 0,
             f"--tp {self.tp} must divide the GPT's output layer of {VOCAB} bytes, split "
             "between the processes: use a power of 2"),
            (self.shard_size is None or self.shard_size >= 1,
             f"--shard-size must be >= 1, got {self.shard_size}"),
            (self.shard_size is None or self.strategy == "hsdp",
             "--shard-size sets the shard dimension of HSDP's mesh: use it with --strategy hsdp"),
            (not sharded or self.precision != "fp16",
             f"--strategy {self.strategy} runs no fp16 gradient scaler here: use --precision "
             "bf16 (or fp32)"),
            (not sharded or not self.step_graph,
             "--step-graph records DDP's step: use it with --strategy ddp"),
            (not sharded or self.compile == "none",
             f"--compile is wired for --strategy ddp here: leave it out with {self.strategy}"),
        )

    def _check_gpt(self) -> None:
        check(*shape_rules(self.dim, self.heads, self.layers, self.seq),
              (self.epoch_steps >= 1, f"--epoch-steps must be >= 1, got {self.epoch_steps}"),
              (math.isfinite(self.gpt_lr) and self.gpt_lr > 0,
               f"--gpt-lr must be a number > 0, got {self.gpt_lr}"),
              (self.data in ("auto", "synthetic"),
               f"--model gpt trains on --data auto (the Python standard library's source) or "
               f"synthetic (random bytes), not {self.data}"))
        wrn_only = [flag for flag, given in (
            ("--lr", self.lr != WRN_LR), ("--dropout", self.dropout),
            ("--label-smoothing", self.label_smoothing), ("--crop-pad", self.crop_pad != 4),
            ("--tta", self.tta), ("--precision fp16", self.precision == "fp16"),
            ("--sync-bn", self.sync_bn), ("--ghost-bn", self.ghost_bn),
            ("--step-graph", self.step_graph), ("--loader", self.loader != "device"),
            ("--limit-per-class", self.limit_per_class is not None)) if given]
        if wrn_only:
            raise ConfigError(f"{', '.join(wrn_only)}: Wide-ResNet settings, which --model gpt "
                              "does not use; leave them out (the GPT's learning rate is "
                              "--gpt-lr, its precision bf16 or fp32)")

    @property
    def gpt(self) -> GPTConfig:
        return GPTConfig(seq=self.seq, layers=self.layers, heads=self.heads, dim=self.dim)

    @property
    def sharded(self) -> bool:
        """Whether the strategy shards the model (and checkpoints with DCP)."""
        return self.strategy in SHARDED

    def data_parallel(self, world_size: int) -> int:
        """How many slices the global batch is cut into: the processes, over --tp."""
        return world_size // self.tp

    def batches(self, world_size: int) -> tuple[int, int]:
        """(per-process batch, global batch) for ``world_size`` processes."""
        if self.scaling == "strong" and self.batch % world_size:
            raise ConfigError(f"global --batch {self.batch} is not divisible by {world_size} "
                              f"processes; use a multiple of {world_size}, or --scaling weak")
        per_gpu = self.batch if self.scaling == "weak" else self.batch // world_size
        if per_gpu % self.grad_accum:
            raise ConfigError(f"--grad-accum {self.grad_accum} does not divide the batch of "
                              f"{per_gpu} per process; use a divisor of {per_gpu}")
        return per_gpu, per_gpu * world_size

    def peak_lr(self, world_size: int) -> float:
        """The linear scaling rule (Goyal et al.): the rate grows with the global batch. The
        GPT's AdamW takes --gpt-lr as it is."""
        if self.model == "gpt":
            return self.gpt_lr
        return self.lr * self.batches(world_size)[1] / REFERENCE_BATCH


# What a resume does with each setting, read from the fields: a new setting is classified where
# it is declared, and a test fails if it is not.
MUST_MATCH_ON_RESUME = tuple(f.name for f in dataclasses.fields(TrainConfig)
                             if f.metadata.get("resume") == "must match")
# The options added after runs were recorded, each with the value those runs trained with.
OLDER_DEFAULTS = {f.name: f.metadata["older"] for f in dataclasses.fields(TrainConfig)
                  if "older" in f.metadata}


def saved_train_config(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved :class:`TrainConfig` dict in today's fields: before ``--precision`` existed, runs
    said ``bf16: true`` (autocast) or ``false`` (fp32), and none had the options in
    OLDER_DEFAULTS."""
    new = {**OLDER_DEFAULTS, **saved}
    if "bf16" in new:
        bf16 = new.pop("bf16")
        new.setdefault("precision", "bf16" if bf16 else "fp32")
    return new


# --- The run ------------------------------------------------------------------------------------

class Diverged(RuntimeError):
    """The loss or the weights stopped being sane numbers; the message says where and what to
    do."""


# What a resume cannot fix: it repeats the same steps, and must keep the checkpoint's --lr.
AFTER_DIVERGING = ("start afresh in another --out with a lower --lr (a resume keeps the "
                   "checkpoint's --lr and would repeat the same steps)")
# No trained network comes near this; fp32 ends at 3.4e38, and a weight this large is one
# update away from overflowing. Above it, or not finite, the weights are not saved.
WEIGHT_LIMIT = 1e30


def fingerprint(data: Cifar10, images: int = 1024) -> str:
    """A short SHA-256 of the training labels and of ``images`` training images spread over
    the set: two copies of a set match wherever they lie, two different sets do not."""
    x, y = data.train_x, data.train_y
    h = hashlib.sha256(f"{tuple(x.shape)} {x.dtype}".encode())
    h.update(y.cpu().contiguous().numpy().tobytes())
    h.update(x[:: max(1, len(x) // images)].cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def lr_factor(cfg: TrainConfig, step: int, steps_per_epoch: int) -> float:
    """Multiplier of the peak learning rate at optimizer step ``step``."""
    epoch = step / steps_per_epoch
    if epoch < cfg.warmup_epochs:
        return (epoch + 1 / steps_per_epoch) / cfg.warmup_epochs
    if cfg.schedule == "step":
        return 0.2 ** sum(epoch >= f * cfg.epochs for f in (0.3, 0.6, 0.8))
    if cfg.schedule == "cosine":
        done = min(1.0, (epoch - cfg.warmup_epochs) / max(cfg.epochs - cfg.warmup_epochs, 1e-9))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done))
    return max(0.0, (cfg.epochs - epoch) / max(cfg.epochs - cfg.warmup_epochs, 1e-9))


META = "trainer.pt"  # in each sharded checkpoint: what DCP's shards do not hold


class CheckpointedRun:
    """What the Wide-ResNet's and the GPT's runs share: the checkpoint, in their strategy's
    format, and the injected faults. A subclass sets ``cfg``, ``ctx``, ``net`` (the wrapped
    model under a sharded strategy), ``optimizer``, ``scheduler``, ``scaler``,
    ``steps_per_epoch``, ``start_epoch``, ``dataset`` and, when sharded, ``saver``."""

    saver: AsyncCheckpointer | None = None

    @property
    def checkpoint_path(self) -> Path:
        """checkpoint.pt (DDP), or the folder of the step-N checkpoints (fsdp2, hsdp)."""
        return self.cfg.out / ("checkpoints" if self.cfg.sharded else "checkpoint.pt")

    def has_checkpoint(self) -> bool:
        """Whether --resume finds a checkpoint in --out: of this strategy, or of another (which
        :meth:`restore` then refuses, naming it)."""
        return self._latest(quiet=True) is not None or self._foreign() is not None

    def _latest(self, quiet: bool = False) -> Path | None:
        if not self.cfg.sharded:
            return self.checkpoint_path if self.checkpoint_path.exists() else None
        return latest_checkpoint(self.checkpoint_path, quiet=quiet or not self.ctx.is_main)

    def _foreign(self) -> Path | None:
        """The file that says how another strategy's checkpoint in --out was trained."""
        if self.cfg.sharded:
            path = self.cfg.out / "checkpoint.pt"
            return path if path.exists() else None
        found = latest_checkpoint(self.cfg.out / "checkpoints", quiet=True)
        return found / META if found else None

    def _state(self, epoch: int, rngs: Any) -> dict[str, Any]:
        """Everything but the model and the optimizer: the schedule, the random states, and
        what the run trains."""
        return {"scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                "rng": rngs, "epoch": epoch, "config": to_dict(self.cfg),
                "world_size": self.ctx.world_size, "dataset": self.dataset}

    def save(self, epoch: int) -> dict[str, float]:
        """Every rank checks the weights and sends its random state; the checkpoint is then
        written: by rank 0 (DDP, one file), or by every rank, its shards, while training goes on
        (fsdp2, hsdp). Weights that diverged are never saved: the last good checkpoint stays.

        Returns what a sharded save cost the loop: ``save_stall_s``, the seconds it held the
        step (DDP's synchronous save: {}).
        """
        if self.cfg.sharded:
            return self._save_sharded(epoch)
        self._check_weights(epoch)
        rngs = ckpt.gather_rng_states(self.ctx)
        if self.ctx.is_main:
            ckpt.save_checkpoint(self.checkpoint_path, {
                "model": self.net.state_dict(), "optimizer": self.optimizer.state_dict(),
                **self._state(epoch, rngs)})
        return {}

    def _save_sharded(self, epoch: int) -> dict[str, float]:
        self._check_weights(epoch)
        broadcast_buffers(self.net, self.ctx)  # BatchNorm: rank 0's statistics, as DDP keeps
        state = self._state(epoch, ckpt.gather_rng_states(self.ctx))
        held = self.saver.save((epoch + 1) * self.steps_per_epoch, self.net, self.optimizer,
                               extra=lambda folder: ckpt.save_checkpoint(folder / META, state))
        if os.environ.get(SAVE_CRASH_ENV) == str(epoch + 1):
            self._simulated_crash(f"while its save of epoch {epoch + 1} is written")
        return {"save_stall_s": held}

    def close(self) -> None:
        """Wait for a save still being written (sharded strategies), committed: every rank
        calls it."""
        if self.saver is not None:
            self.saver.close()

    def _check_weights(self, epoch: int) -> None:
        """Raise :class:`Diverged` on every rank if any rank's weights or BatchNorm statistics
        are not finite or beyond WEIGHT_LIMIT: with BatchNorm, weights can grow without bound
        while the loss stays finite. Sharded, each rank checks its shards."""
        floats = {k: v.to_local() if isinstance(v, DTensor) else v
                  for k, v in self.net.state_dict().items() if v.is_floating_point()}
        sane = torch.stack([(v.abs() <= WEIGHT_LIMIT).all() for v in floats.values()])
        if not all_reduce_sum(self.ctx, float(not sane.all()))[0]:
            return
        bad = [k for k, ok in zip(floats, sane.tolist(), strict=True) if not ok]
        where = f" (first: {bad[0]})" if bad else " on another rank"
        raise Diverged(f"after epoch {epoch + 1} the weights are not finite or beyond "
                       f"{WEIGHT_LIMIT:g} in magnitude{where}, so they were not saved; "
                       f"{AFTER_DIVERGING}")

    def _load_state(self, path: Path, required: tuple[str, ...] = ()) -> dict[str, Any]:
        return ckpt.load_checkpoint(
            path, {k: getattr(self.cfg, k) for k in MUST_MATCH_ON_RESUME}, required=required,
            upgrade=saved_train_config)

    def restore(self) -> None:
        found = self._latest()
        if found is None and (foreign := self._foreign()) is not None:
            self._load_state(foreign)  # refused: it names the strategy it was written with
            raise ckpt.CheckpointError(f"{foreign} is not a checkpoint of --strategy "
                                       f"{self.cfg.strategy}; {ckpt.AFRESH}")
        if not self.cfg.sharded:
            self._restore_file()
        elif found is None:
            raise ckpt.CheckpointError(f"no complete checkpoint in {self.checkpoint_path}; "
                                       "resume from another --out, or leave out --resume")
        else:
            self._restore_sharded(found)

    def _restore_file(self) -> None:
        path = self.checkpoint_path
        state = self._load_state(path, required=("model", "optimizer", "scheduler", "rng",
                                                 "epoch", "world_size", "dataset"))
        ckpt.check_world_size(state, self.ctx.world_size, path)
        self._check_dataset(state["dataset"], path)
        self.net.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self._restore_rest(state)

    def _restore_sharded(self, path: Path) -> None:
        """Any number of processes, any mesh, resumes a sharded checkpoint: DCP reads the
        slices each rank's shards need. With --scaling weak the global batch would change."""
        verify(path)  # every file against its digest, before anything of it is read
        state = self._load_state(path / META, required=("scheduler", "rng", "epoch",
                                                        "world_size", "dataset"))
        saved, world = state["world_size"], self.ctx.world_size
        if saved != world and self.cfg.scaling == "weak":
            raise ckpt.CheckpointError(
                f"{path} was written by {saved} processes with --scaling weak, this run has "
                f"{world}: the global batch and the learning rate would change; resume with "
                f"{saved} processes (or train with --scaling strong, which any number of "
                "processes can resume)")
        self._check_dataset(state["dataset"], path)
        load_sharded(path, self.net, self.optimizer, verified=True,
                     no_dist=not self.ctx.is_distributed)
        self._restore_rest(state)

    def _restore_rest(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state.get("scaler", {}))
        rngs, rank = state["rng"], self.ctx.rank
        if len(rngs) == self.ctx.world_size or not self.cfg.sharded:
            ckpt.set_rng_state(ckpt.rng_state_for_rank(rngs, rank), self.ctx.device)
        else:  # resharded: each rank's random draws (dropout) start from a seed of its own
            torch.manual_seed(self.cfg.seed * 1_000_003 + state["epoch"] * 1009 + rank)
            random.seed(self.cfg.seed * 1_000_003 + state["epoch"] * 1009 + rank)
            self._on_another_world(len(rngs))
        self.start_epoch = state["epoch"] + 1

    def _on_another_world(self, saved: int) -> None:
        """What a resume on another number of processes changes; the GPT: nothing."""

    def _check_dataset(self, saved: dict[str, Any], path: Path) -> None:
        now = self.dataset
        # older checkpoints hold no fingerprint: their name and size must match, as then
        same = (saved["fingerprint"] == now["fingerprint"] if "fingerprint" in saved else
                (saved["name"], saved["train_images"]) == (now["name"], now["train_images"]))
        if not same:
            if "train_images" in saved:
                raise ckpt.CheckpointError(
                    f"{path} was trained on {saved['name']} ({saved['train_images']} images), "
                    f"this run has {now['name']} ({now.get('train_images')}), other images or "
                    "labels; use the same data and --limit-per-class, or another --out")
            raise ckpt.CheckpointError(
                f"{path} was trained on {saved['name']}, this run has {now['name']}, another "
                "text; use the same --data (and Python, for its standard library), or another "
                "--out")

    def _simulated_crash(self, when: int | str) -> None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if self.ctx.rank == self.ctx.world_size - 1 and first_attempt:
            at = f"at step {when}" if isinstance(when, int) else when
            print(f"rank {self.ctx.rank}: simulated crash {at}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no checkpoint: a real crash

    def _first(self, first_bad: torch.Tensor) -> int:
        """The earliest of every rank's first bad step: one rank's NaN reaches the others'
        weights through the all-reduce, and their losses only at the next step."""
        step = torch.where(first_bad < 0, torch.iinfo(torch.int64).max, first_bad).long()
        if self.ctx.is_distributed:
            dist.all_reduce(step, op=dist.ReduceOp.MIN)
        return int(step.item())


@dataclass
class Trainer(CheckpointedRun):
    """The Wide-ResNet's model, data, optimizer and schedule, and one epoch of each phase."""

    cfg: TrainConfig
    ctx: DistContext
    data: Cifar10
    start_epoch: int = 0

    def __post_init__(self) -> None:
        cfg, ctx = self.cfg, self.ctx
        self.mesh = build_mesh(ctx, cfg.strategy, cfg.shard_size)  # None under DDP
        self.data_world = ctx.world_size
        self.per_gpu, self.global_batch = cfg.batches(ctx.world_size)
        self.net = self._network()
        # With --step-graph, warm_up() records forward and backward into one CUDA graph;
        # DDP must be built on the stream that records it.
        self.graph = StepGraph(ctx.device, enabled=cfg.step_graph)
        self._replay = None
        if cfg.sharded:  # FSDP2 flattens each weight into its shard: no channels_last
            self.net.to(ctx.device)
            # fp32 parameters, bf16 from autocast as under DDP: BatchNorm's stay fp32
            self.model = self.net = wrap_wrn(
                self.net, ctx, self.mesh, policy=precision_policy(ctx.device, "fp32"),
                reshard_after_forward=cfg.reshard_after_forward)
            self.saver = AsyncCheckpointer(self.checkpoint_path, ctx, cfg.async_save)
        else:
            self.net.to(ctx.device, memory_format=torch.channels_last)
            with self.graph.stream():
                self.model = ddp(compile_for_ddp(self.net, cfg.compile, ctx), ctx)
        self.train_loader = self._train_loader()
        self.steps_per_epoch = len(self.train_loader)
        if self.steps_per_epoch == 0:
            n = len(self.data.train_x)
            raise ConfigError(
                f"--batch {cfg.batch} needs {self.per_gpu} images per process and step, but "
                f"each of the {ctx.world_size} processes has {n // ctx.world_size} of the {n} "
                "training images; use a smaller --batch or more data")
        # fused: on a GPU, decay, momentum and update in one pass over the tensors, not three.
        # Built after the wrapping: under FSDP2 it updates each rank's shards.
        self.optimizer = torch.optim.SGD(
            self.net.parameters(), lr=cfg.peak_lr(ctx.world_size), momentum=0.9,
            nesterov=True, weight_decay=cfg.weight_decay, fused=ctx.device.type == "cuda" or None)
        # fp16: the loss is scaled up before backward so that small gradients do not flush to
        # zero, and the gradients unscaled before the step; disabled, it passes everything on.
        self.scaler = torch.amp.GradScaler(ctx.device.type, enabled=cfg.precision == "fp16")
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(cfg, s, self.steps_per_epoch))
        self.test_loader = DeviceLoader(self.data.test_x, self.data.test_y, 500,
                                        device=ctx.device, rank=ctx.rank,
                                        world_size=ctx.world_size, train=False,
                                        channels_last=True)

    def _network(self) -> nn.Module:
        """The Wide-ResNet, its BatchNorm as --sync-bn or --ghost-bn ask."""
        cfg, ctx = self.cfg, self.ctx
        torch.manual_seed(cfg.seed)  # the same initial weights in every process
        net = WideResNet(cfg.depth, cfg.width, dropout=cfg.dropout)
        if cfg.sync_bn and ctx.is_distributed:  # statistics all-reduced in every forward
            if ctx.device.type != "cuda":
                raise ConfigError("--sync-bn needs a GPU per process: PyTorch's SyncBatchNorm "
                                  "does not run on CPU processes; leave it out there")
            net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
        if cfg.ghost_bn:  # statistics over groups of each micro-batch, as on more GPUs
            micro = self.per_gpu // cfg.grad_accum
            if micro % cfg.ghost_bn or micro == cfg.ghost_bn:
                raise ConfigError(f"--ghost-bn {cfg.ghost_bn} must split the {micro} images "
                                  "each process normalises at once into groups; use a divisor "
                                  f"of {micro} smaller than it")
            net = ghost_batchnorm(net, cfg.ghost_bn)
        return net

    def _train_loader(self):
        cfg, ctx, d = self.cfg, self.ctx, self.data
        if cfg.loader == "device":
            return DeviceLoader(d.train_x, d.train_y, self.per_gpu, device=ctx.device,
                                rank=ctx.rank, world_size=ctx.world_size, seed=cfg.seed,
                                channels_last=True, crop_pad=cfg.crop_pad)
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        workers = min(8, (os.cpu_count() or 1) // local_world)
        return dataloader(d.train_x, d.train_y, self.per_gpu, rank=ctx.rank,
                          world_size=ctx.world_size, seed=cfg.seed, workers=workers,
                          pin_memory=ctx.device.type == "cuda", crop_pad=cfg.crop_pad)

    @functools.cached_property
    def dataset(self) -> dict[str, object]:
        """What a resume checks it trains on: a fingerprint of the training set, whatever path
        it was read from (the name and size say what it was)."""
        return {"name": self.data.name, "train_images": len(self.data.train_x),
                "fingerprint": fingerprint(self.data)}

    def train_one_epoch(self, epoch: int) -> dict[str, float]:
        dev = self.ctx.device
        self.model.train()
        self.train_loader.set_epoch(epoch)  # a new shuffle and new augmentations, every rank
        loss_sum = torch.zeros((), device=dev)
        correct = torch.zeros((), device=dev, dtype=torch.long)
        seen = 0
        first_bad = torch.full((), -1, device=dev)  # the first step with a non-finite loss
        crash_at = int(os.environ.get(CRASH_ENV, -1))
        synchronize(dev)
        t0 = time.perf_counter()
        for i, (x, y) in enumerate(self.train_loader, start=epoch * self.steps_per_epoch):
            if i == crash_at:
                self._simulated_crash(i)
            x, y = self._on_device(x, y)
            out, loss = self.forward_backward(x, y)
            if self.cfg.clip_norm is not None:  # DDP's gradients are already the average
                self.scaler.unscale_(self.optimizer)  # fp16: clip the true gradients
                if self.cfg.sharded:  # the norm over every rank's shards
                    clip_gradients(list(self.net.parameters()), self.cfg.clip_norm)
                else:
                    nn.utils.clip_grad_norm_(self.net.parameters(), self.cfg.clip_norm)
            self.scaler.step(self.optimizer)  # fp16: skipped if a gradient overflowed
            self.scaler.update()
            self.scheduler.step()
            # Accumulate on the device: a .item() per step would stall the GPU queue.
            loss_sum += loss.detach() * len(y)
            correct += (out.argmax(1) == y).sum()
            seen += len(y)
            first_bad = torch.where((first_bad < 0) & ~loss.isfinite(), i, first_bad)
        synchronize(dev)
        seconds = time.perf_counter() - t0
        loss_total, correct_total, n = all_reduce_sum(self.ctx, loss_sum.item(),
                                                      correct.item(), seen)
        if not math.isfinite(loss_total):  # the same sum on every rank: all of them stop
            raise Diverged(f"the loss was not finite from step {self._first(first_bad) + 1} "
                           f"on (epoch {epoch + 1}), and nothing of this epoch was saved; "
                           f"{AFTER_DIVERGING}")
        return {"epoch_time_s": seconds, "images_per_s": n / seconds,
                "train_loss": loss_total / n, "train_acc": correct_total / n}

    def _on_device(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if x.dtype == torch.uint8:  # DataLoader batches arrive as bytes on the host
            dev = self.ctx.device
            x = normalize(x.to(dev, non_blocking=True), channels_last=True)
            y = y.to(dev, non_blocking=True)
        return x, y

    def forward_backward(self, x: torch.Tensor,
                         y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Outputs and loss of one batch, its gradients left for the optimizer."""
        if self._replay is None:
            self.optimizer.zero_grad(set_to_none=True)
            return self._forward_backward(x, y)
        self.static_x.copy_(x)  # the graph reads its batch from these
        self.static_y.copy_(y)
        return self._replay()

    def _forward_backward(self, x: torch.Tensor,
                          y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg  # DDP's all-reduce, FSDP2's reduce-scatter: in the last backward only
        return accumulate(self.model, x, y, cfg.grad_accum, cfg.precision,
                          cfg.label_smoothing, self.scaler.scale)

    def warm_up(self, steps: int = 3) -> float:
        """Compile the step (and record its CUDA graph) before the clock starts; seconds taken.

        The warm-up steps take no optimizer step, and the weights, BatchNorm statistics and
        random generators are put back afterwards: the training that follows is the one it
        would have been without them.
        """
        dev = self.ctx.device
        saved = {k: v.clone() for k, v in self.net.state_dict().items()}
        rng = ckpt.rng_state(dev)
        synchronize(dev)
        t0 = time.perf_counter()
        self.model.train()
        x, y = self._on_device(*next(iter(self.train_loader)))
        if self.cfg.step_graph:
            self.static_x, self.static_y = x.clone(), y.clone()
            self._replay = self.graph.capture(
                lambda: self._forward_backward(self.static_x, self.static_y),
                self.net, self.optimizer)
        else:
            for _ in range(steps):
                self._forward_backward(x, y)
            self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():  # in place: compiled graphs keep pointing at the same tensors
            for k, v in self.net.state_dict().items():
                v.copy_(saved[k])
        ckpt.set_rng_state(rng, dev)
        synchronize(dev)
        return time.perf_counter() - t0

    @torch.no_grad()
    def evaluate(self) -> float:
        if self.cfg.sharded:  # FSDP2 leaves each rank its own BatchNorm statistics
            broadcast_buffers(self.net, self.ctx)
        self.model.eval()
        correct = torch.zeros((), device=self.ctx.device, dtype=torch.long)
        seen = 0
        dtype = AUTOCAST[self.cfg.precision]
        autocast = functools.partial(torch.autocast, self.ctx.device.type,
                                     dtype=dtype or torch.bfloat16, enabled=dtype is not None)
        for x, y in self._test_batches():
            with autocast():
                correct += (predict(self.model, x, self.cfg.tta).argmax(1) == y).sum()
            seen += len(y)
        total_correct, n = all_reduce_sum(self.ctx, correct.item(), seen)
        return total_correct / n

    def _test_batches(self):
        """The test loader's batches; sharded, as many on every rank (padded with empty ones):
        each forward gathers the parameters, and every rank must take part."""
        if not self.cfg.sharded:
            yield from self.test_loader
            return
        mine = len(self.test_loader)
        most = int(all_reduce_max(self.ctx, mine))  # before any forward
        yield from self.test_loader
        x = torch.zeros(0, 3, 32, 32, device=self.ctx.device)
        for _ in range(most - mine):
            yield x, torch.zeros(0, dtype=torch.long, device=self.ctx.device)

    def _on_another_world(self, saved: int) -> None:
        if self.ctx.is_main:
            print(f"--resume on {self.ctx.world_size} processes from a checkpoint of {saved}: "
                  "each rank's share of the images, its augmentations and its dropout differ "
                  f"from what {saved} processes would have drawn", file=sys.stderr, flush=True)


def all_reduce_max(ctx: DistContext, value: float) -> float:
    t = torch.tensor(float(value), dtype=torch.float64, device=ctx.device)
    if ctx.is_distributed:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()
