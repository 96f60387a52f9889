"""One training run's pieces: model, data, optimizer and schedule, and one epoch of each phase.

:mod:`tutorial_utils.train` builds a :class:`Trainer` from its configuration and drives it;
the parts a reader copies into their own loop are here, each short: the learning-rate
schedule, a DDP-wrapped (optionally compiled, optionally graphed) network, the epoch loop,
checkpoint save and restore, and evaluation. The step they run is :mod:`tutorial_utils.step`'s.
"""

from __future__ import annotations

import math
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from . import checkpoint as ckpt
from .config import ConfigError, TrainConfig, saved_train_config, to_dict
from .data import Cifar10
from .loaders import DeviceLoader, dataloader, normalize
from .models import WideResNet, ghost_batchnorm
from .parallel.ddp import compile_for_ddp, ddp
from .parallel.distributed import DistContext, all_reduce_sum
from .step import AUTOCAST, accumulate, predict
from .step_graph import StepGraph
from .timing import synchronize

CRASH_ENV = "TUTORIAL_CRASH_AT_STEP"  # fault injection for chapter 6's demo, not a setting

# What a resume must share with the run it continues: the model, the data and its order, the
# optimisation and its numerics. Other settings (--tta, --compile, --step-graph, --device,
# --deterministic, --checkpoint-every) change how the run executes, not what it trains; a resume
# may change them, and each attempt's start record in metrics.jsonl says what it used.
RESUME_MUST_MATCH = ("depth", "width", "dropout", "batch", "scaling", "seed", "epochs",
                     "schedule", "warmup_epochs", "lr", "weight_decay", "label_smoothing",
                     "crop_pad", "precision", "loader", "grad_accum", "clip_norm", "sync_bn",
                     "ghost_bn")


class Diverged(RuntimeError):
    """The loss stopped being a finite number; the message says where and what to do."""


def lr_factor(cfg: TrainConfig, step: int, steps_per_epoch: int) -> float:
    """Multiplier of the peak learning rate at optimizer step ``step``."""
    epoch = step / steps_per_epoch
    if epoch < cfg.warmup_epochs:
        return (epoch + 1 / steps_per_epoch) / cfg.warmup_epochs
    if cfg.schedule == "step":
        return 0.2 ** sum(epoch >= f * cfg.epochs for f in (0.3, 0.6, 0.8))
    return max(0.0, (cfg.epochs - epoch) / max(cfg.epochs - cfg.warmup_epochs, 1e-9))


@dataclass
class Trainer:
    """The model, data, optimizer and schedule of one run, and one epoch of each phase."""

    cfg: TrainConfig
    ctx: DistContext
    data: Cifar10
    start_epoch: int = 0

    def __post_init__(self) -> None:
        cfg, ctx = self.cfg, self.ctx
        self.per_gpu, self.global_batch = cfg.batches(ctx.world_size)
        torch.manual_seed(cfg.seed)  # the same initial weights in every process
        self.net = WideResNet(cfg.depth, cfg.width, dropout=cfg.dropout)
        if cfg.sync_bn and ctx.is_distributed:  # statistics all-reduced in every forward
            if ctx.device.type != "cuda":
                raise ConfigError("--sync-bn needs a GPU per process: PyTorch's SyncBatchNorm "
                                  "does not run on CPU processes; leave it out there")
            self.net = nn.SyncBatchNorm.convert_sync_batchnorm(self.net)
        if cfg.ghost_bn:  # statistics over groups of each micro-batch, as on more GPUs
            micro = self.per_gpu // cfg.grad_accum
            if micro % cfg.ghost_bn or micro == cfg.ghost_bn:
                raise ConfigError(f"--ghost-bn {cfg.ghost_bn} must split the {micro} images "
                                  "each process normalises at once into groups; use a divisor "
                                  f"of {micro} smaller than it")
            self.net = ghost_batchnorm(self.net, cfg.ghost_bn)
        self.net.to(ctx.device, memory_format=torch.channels_last)
        # With --step-graph, warm_up() records forward and backward into one CUDA graph;
        # DDP must be built on the stream that records it.
        self.graph = StepGraph(ctx.device, enabled=cfg.step_graph)
        self._replay = None
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
        # fused: on a GPU, decay, momentum and update in one pass over the tensors, not three
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

    @property
    def checkpoint_path(self) -> Path:
        return self.cfg.out / "checkpoint.pt"

    @property
    def dataset(self) -> dict[str, object]:
        """What a resume checks it trains on: the data set's name and size, not its path."""
        return {"name": self.data.name, "train_images": len(self.data.train_x)}

    def save(self, epoch: int) -> None:
        """Every rank sends its random state; rank 0 writes the checkpoint."""
        rngs = ckpt.gather_rng_states(self.ctx)
        if self.ctx.is_main:
            ckpt.save_checkpoint(self.checkpoint_path, {
                "model": self.net.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                "rng": rngs, "epoch": epoch,
                "config": to_dict(self.cfg), "world_size": self.ctx.world_size,
                "dataset": self.dataset})

    def restore(self) -> None:
        path = self.checkpoint_path
        state = ckpt.load_checkpoint(
            path, {k: getattr(self.cfg, k) for k in RESUME_MUST_MATCH},
            required=("model", "optimizer", "scheduler", "rng", "epoch", "world_size", "dataset"),
            upgrade=saved_train_config)
        ckpt.check_world_size(state, self.ctx.world_size, path)
        if state["dataset"] != self.dataset:
            saved, now = state["dataset"], self.dataset
            raise ckpt.CheckpointError(
                f"{path} was trained on {saved['name']} ({saved['train_images']} images), this "
                f"run has {now['name']} ({now['train_images']}); use the same --data and "
                "--limit-per-class, or another --out")
        self.net.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state.get("scaler", {}))
        ckpt.set_rng_state(ckpt.rng_state_for_rank(state["rng"], self.ctx.rank), self.ctx.device)
        self.start_epoch = state["epoch"] + 1

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
            raise Diverged(f"the loss was not finite from step {first_bad.item() + 1} on "
                           f"(epoch {epoch + 1}), and nothing of this epoch was saved; lower "
                           "--lr, then resume from the last checkpoint or start afresh")
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
        return accumulate(self.model, x, y, self.cfg.grad_accum, self.cfg.precision,
                          self.cfg.label_smoothing, self.scaler.scale)

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

    def _simulated_crash(self, step: int) -> None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if self.ctx.rank == self.ctx.world_size - 1 and first_attempt:
            print(f"rank {self.ctx.rank}: simulated crash at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no checkpoint: a real crash

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        correct = torch.zeros((), device=self.ctx.device, dtype=torch.long)
        seen = 0
        for x, y in self.test_loader:
            dtype = AUTOCAST[self.cfg.precision]
            with torch.autocast(self.ctx.device.type, dtype=dtype or torch.bfloat16,
                                enabled=dtype is not None):
                correct += (predict(self.model, x, self.cfg.tta).argmax(1) == y).sum()
            seen += len(y)
        total_correct, n = all_reduce_sum(self.ctx, correct.item(), seen)
        return total_correct / n
