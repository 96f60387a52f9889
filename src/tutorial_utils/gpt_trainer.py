"""The GPT's training run: chapter 7's model on text, under any strategy of the entry point.

:mod:`tutorial_utils.train` builds a :class:`GPTTrainer` for ``--model gpt`` and drives it as it
drives the Wide-ResNet's :class:`~tutorial_utils.trainer.Trainer`: the same configuration, the
same checkpoints (one file under DDP; DCP's sharded folders, saved asynchronously, under fsdp2
and hsdp), the same epoch records. What differs is here: the text and its batches, AdamW, the
language-model loss, and an evaluation on held-out windows.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import os
import time
from dataclasses import dataclass

import torch

from .models.gpt import GPT, lm_loss
from .parallel.ddp import compile_for_ddp, ddp
from .parallel.distributed import DistContext, all_reduce_sum
from .parallel.strategy import (
    build_mesh,
    clip_gradients,
    data_parallel_rank,
    precision_policy,
    wrap_gpt,
)
from .sharded_checkpoint import AsyncCheckpointer
from .step import AUTOCAST, accumulate_gradients
from .text import Corpus, batch
from .timing import synchronize
from .trainer import CRASH_ENV, CheckpointedRun, Diverged, TrainConfig, lr_factor

EVAL_BATCHES = 4  # held-out batches per evaluation of the GPT: the same windows every time


def text_fingerprint(text: Corpus, samples: int = 1 << 20) -> str:
    """A short SHA-256 of the text's size and of ``samples`` bytes spread over it."""
    h = hashlib.sha256(f"{len(text.train)} {len(text.val)}".encode())
    for part in (text.train, text.val):
        h.update(part[:: max(1, len(part) // samples)].contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


@dataclass
class GPTTrainer(CheckpointedRun):
    """The GPT's model, text, optimizer and schedule: chapter 7's recipe (AdamW, warm-up then
    the schedule, clipped gradients, bf16 autocast on GPUs), under any strategy.

    An epoch is ``--epoch-steps`` optimizer steps. The batch of step ``i`` is drawn from
    ``(seed, i)`` alone and each data-parallel rank takes its rows of it: one process, N
    processes and N processes in tensor-parallel groups train on the same windows.
    """

    cfg: TrainConfig
    ctx: DistContext
    data: Corpus
    start_epoch: int = 0

    def __post_init__(self) -> None:
        cfg, ctx = self.cfg, self.ctx
        self.mesh = build_mesh(ctx, cfg.strategy, cfg.shard_size, cfg.tp)
        self.data_rank, self.data_world = data_parallel_rank(ctx, self.mesh)
        self.per_gpu, self.global_batch = cfg.batches(self.data_world)
        torch.manual_seed(cfg.seed)  # the same initial weights in every process
        self.net = GPT(cfg.gpt).to(ctx.device)
        self.graph = contextlib.nullcontext()  # no --step-graph for the GPT
        if cfg.sharded:
            self.model = self.net = wrap_gpt(
                self.net, ctx, self.mesh, policy=precision_policy(ctx.device, cfg.precision),
                reshard_after_forward=cfg.reshard_after_forward)
            self.saver = AsyncCheckpointer(self.checkpoint_path, ctx, cfg.async_save)
        else:
            self.model = ddp(compile_for_ddp(self.net, cfg.compile, ctx), ctx)
        self.steps_per_epoch = cfg.epoch_steps
        # Built after the wrapping: under FSDP2 it updates each rank's shards. Fused on a GPU,
        # but not over FSDP2 x TP's two meshes.
        fused = ctx.device.type == "cuda" and cfg.tp == 1
        self.optimizer = torch.optim.AdamW(
            self.net.parameters(), lr=cfg.peak_lr(self.data_world), betas=(0.9, 0.95),
            weight_decay=cfg.weight_decay, fused=fused or None)
        self.scaler = torch.amp.GradScaler(ctx.device.type, enabled=False)  # bf16 or fp32
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(cfg, s, self.steps_per_epoch))

    @functools.cached_property
    def dataset(self) -> dict[str, object]:
        """What a resume checks it trains on: the text's name and a fingerprint of it."""
        return {"name": self.data.name, "train_bytes": len(self.data.train),
                "fingerprint": text_fingerprint(self.data)}

    def rows(self, text: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of the global batch of windows drawn from ``seed``."""
        x, y = batch(text, self.global_batch, self.cfg.seq, torch.Generator().manual_seed(seed))
        mine = slice(self.data_rank * self.per_gpu, (self.data_rank + 1) * self.per_gpu)
        dev = self.ctx.device
        return x[mine].to(dev, non_blocking=True), y[mine].to(dev, non_blocking=True)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The inputs and targets of optimizer step ``step``, this rank's rows."""
        return self.rows(self.data.train, self.cfg.seed * 1_000_003 + step)

    def _forward_loss(self, x: torch.Tensor, y: torch.Tensor) -> tuple[None, torch.Tensor]:
        dtype = AUTOCAST[self.cfg.precision]
        with torch.autocast(self.ctx.device.type, dtype=dtype or torch.bfloat16,
                            enabled=dtype is not None):
            return None, lm_loss(self.model(x), y)

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The mean loss of this rank's rows, its gradients (reduced over the ranks) left for
        the optimizer: ``--grad-accum`` micro-batches, reduced in the last backward only."""
        self.optimizer.zero_grad(set_to_none=True)
        return accumulate_gradients(self.model, x, y, self.cfg.grad_accum,
                                    self._forward_loss)[1]

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One optimizer step: forward and backward, clipping, AdamW, the schedule."""
        loss = self.forward_backward(x, y)
        if self.cfg.clip_norm is not None:
            clip_gradients(list(self.net.parameters()), self.cfg.clip_norm)
        self.optimizer.step()
        self.scheduler.step()
        return loss

    def train_one_epoch(self, epoch: int) -> dict[str, float]:
        dev = self.ctx.device
        self.model.train()
        loss_sum = torch.zeros((), device=dev)
        first_bad = torch.full((), -1, device=dev)  # the first step with a non-finite loss
        crash_at = int(os.environ.get(CRASH_ENV, -1))
        steps = range(epoch * self.steps_per_epoch, (epoch + 1) * self.steps_per_epoch)
        synchronize(dev)
        t0 = time.perf_counter()
        for i in steps:
            if i == crash_at:
                self._simulated_crash(i)
            loss = self.train_step(*self.batch(i))
            loss_sum += loss  # on the device: no .item() per step
            first_bad = torch.where((first_bad < 0) & ~loss.isfinite(), i, first_bad)
        synchronize(dev)
        seconds = time.perf_counter() - t0
        # every rank of a tensor-parallel group adds the same losses: the mean is unchanged
        loss_total, n = all_reduce_sum(self.ctx, loss_sum.item(), len(steps))
        if not math.isfinite(loss_total):
            raise Diverged(f"the loss was not finite from step {self._first(first_bad) + 1} "
                           f"on (epoch {epoch + 1}), and nothing of this epoch was saved; "
                           "start afresh in another --out with a lower --gpt-lr (a resume "
                           "keeps the checkpoint's and would repeat the same steps)")
        tokens = len(steps) * self.global_batch * self.cfg.seq
        return {"epoch_time_s": seconds, "tokens_per_s": tokens / seconds,
                "train_loss": loss_total / n}

    @torch.no_grad()
    def evaluate(self) -> float:
        """The mean loss on EVAL_BATCHES batches of held-out windows, the same each time."""
        self.model.eval()
        total = torch.zeros((), device=self.ctx.device)
        for i in range(EVAL_BATCHES):
            total += self._forward_loss(*self.rows(self.data.val, 10**9 + i))[1]
        self.model.train()
        loss_sum, n = all_reduce_sum(self.ctx, total.item(), EVAL_BATCHES)
        return loss_sum / n

    def warm_up(self, steps: int = 3) -> float:
        """Compile the step before the clock starts; seconds taken. No optimizer step: the
        weights are those it found."""
        synchronize(self.ctx.device)
        t0 = time.perf_counter()
        self.model.train()
        x, y = self.batch(0)
        for _ in range(steps):
            self.forward_backward(x, y)
        self.optimizer.zero_grad(set_to_none=True)
        synchronize(self.ctx.device)
        return time.perf_counter() - t0
