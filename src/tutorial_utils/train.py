"""Train a Wide-ResNet on CIFAR-10: one entry point for the CPU, one GPU, or N under torchrun.

    python -m tutorial_utils.train --epochs 10 --data cifar10-jpeg.tar.gz
    torchrun --standalone --nproc_per_node=2 -m tutorial_utils.train --epochs 10 ...

Rank 0 writes one JSON line per epoch to ``<out>/metrics.jsonl`` (after a first line with the
configuration and the environment stamp) and a checkpoint to ``<out>/checkpoint.pt``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from .checkpoint import CheckpointError, load_checkpoint, rng_state, save_checkpoint, set_rng_state
from .config import ConfigError, parse, to_dict
from .data import Cifar10, DataError, DeviceLoader, dataloader, load_cifar10, normalize
from .devices import NotEnoughGPUsError
from .graphs import StepGraph
from .models import WideResNet
from .models.ghost_norm import convert_ghost_batchnorm
from .parallel.data_parallel import compile_for_ddp
from .parallel.ddp_tuning import DDPTuning
from .parallel.distributed import DistContext, all_reduce_sum, distributed
from .timing import synchronize

REFERENCE_BATCH = 128  # the batch the base learning rate is given for


def opt(default, doc: str):
    """A config field with its ``--help`` text."""
    return field(default=default, metadata={"help": doc})


@dataclass
class TrainConfig:
    depth: int = opt(28, "WRN depth, 6n+4")
    width: int = opt(10, "WRN width factor k")
    dropout: float = opt(0.0, "dropout between the convolutions of a block")
    epochs: int = opt(10, "epochs to train")
    batch: int = opt(128, "global batch (strong scaling) or per-GPU batch (weak scaling)")
    scaling: Literal["strong", "weak"] = opt("strong", "how --batch is shared by the processes")
    lr: float = opt(0.1, f"learning rate at a global batch of {REFERENCE_BATCH}, scaled linearly")
    schedule: Literal["warmup-linear", "step"] = opt(
        "warmup-linear", "short runs: linear warm-up then linear decay; step: the paper's x0.2 "
        "at 30/60/80 %% of the epochs")
    warmup_epochs: float = opt(1.0, "warm-up length for warmup-linear")
    weight_decay: float = opt(5e-4, "L2 weight decay")
    norm_weight_decay: bool = opt(
        True, "decay BatchNorm scales and shifts and the classifier's bias too; "
        "--no-norm-weight-decay decays only convolution and linear weights")
    momentum: float = opt(0.9, "SGD momentum")
    nesterov: bool = opt(True, "Nesterov momentum")
    label_smoothing: float = opt(0.0, "label smoothing of the cross-entropy loss")
    crop_pad: int = opt(4, "augmentation: random crops from images padded by this many "
                        "pixels, plus random mirroring (0: mirroring only)")
    ghost_batch: int = opt(0, "BatchNorm statistics over groups of this many images of each "
                           "process's batch (ghost batch norm: noisier statistics, like a "
                           "smaller batch; 0: the whole batch); each step takes longer")
    tta: bool = opt(False, "test-time augmentation: classify each test image and its mirror "
                    "image, summing the two outputs")
    tta_shift: int = opt(0, "with --tta, also classify both views shifted by this many pixels "
                         "up-left and down-right (edges mirrored), at half weight (0: off)")
    ema: float = opt(0.0, "evaluate an exponential moving average of the weights and "
                     "BatchNorm statistics, updated every step with this decay (0: off); "
                     "the update adds host work to every step")
    bf16: bool = opt(True, "bf16 autocast")
    channels_last: bool = opt(True, "channels_last memory format")
    compile: Literal["none", "default", "reduce-overhead"] = opt("none", "torch.compile mode")
    tune_kernels: bool = opt(
        False, "with --compile: the compiler times block sizes of each kernel it generates and "
        "keeps the fastest (coordinate-descent tuning): faster steps, longer compilation")
    step_graph: bool = opt(
        False, "record forward and backward, DDP's all-reduces included, as one CUDA graph "
        "replayed every step (the optimizer runs after it); with --compile default or none. "
        "On a CPU the step runs eagerly")
    bf16_grads: bool = opt(False, "DDP: all-reduce the gradients in bfloat16 (half the bytes)")
    bucket_view: bool = opt(False, "DDP: gradients are views into the all-reduce buckets")
    bucket_mb: float = opt(25.0, "DDP: gradient bucket size in MB")
    loader: Literal["device", "dataloader"] = opt(
        "device", "device: data kept on the GPU, augmented there; dataloader: CPU workers")
    workers: int = opt(4, "DataLoader worker processes per rank")
    data: str = opt("auto", "auto, torchvision, synthetic, or an image-folder tree / tarball")
    data_dir: Path = opt(Path("data"), "torchvision-layout CIFAR-10 folder (download target)")
    download: bool = opt(True, "download CIFAR-10 into --data-dir if it is missing")
    limit_per_class: int | None = opt(None, "image folders: use only N images per class")
    device: Literal["auto", "cpu", "cuda"] = opt("auto", "cuda needs one GPU per process")
    out: Path = opt(Path("runs/wrn"), "output folder: metrics.jsonl, checkpoint.pt")
    checkpoint_every: int = opt(1, "epochs between checkpoints (0: never)")
    resume: bool = opt(False, "continue from <out>/checkpoint.pt")
    seed: int = opt(0, "seed for initialisation, data order and augmentation")
    deterministic: bool = opt(
        False, "deterministic kernels (no cuDNN autotuning): runs repeat bit for bit, slower")
    crash_at_step: int | None = opt(
        None, "fault-tolerance demo: the last rank dies (SIGKILL) at this global step, on the "
        "first attempt only (torchrun restarts count from 0)")

    def __post_init__(self) -> None:
        if self.depth < 10 or (self.depth - 4) % 6:
            raise ConfigError(f"--depth must be 6n+4 (10, 16, 22, 28, 40, ...), got {self.depth}")
        checks = [
            (self.width >= 1, f"--width must be >= 1, got {self.width}"),
            (0 <= self.dropout < 1, f"--dropout must be in [0, 1), got {self.dropout}"),
            (self.epochs >= 1, f"--epochs must be >= 1, got {self.epochs}"),
            (self.batch >= 1, f"--batch must be >= 1, got {self.batch}"),
            (self.lr > 0, f"--lr must be > 0, got {self.lr}"),
            (self.checkpoint_every >= 0, "--checkpoint-every must be >= 0"),
            (self.workers >= 0, f"--workers must be >= 0, got {self.workers}"),
            (self.crop_pad >= 0, f"--crop-pad must be >= 0, got {self.crop_pad}"),
            (0 <= self.tta_shift < 32, f"--tta-shift must be 0..31 pixels (mirrored edges "
             f"of 32-pixel images), got {self.tta_shift}"),
            (not self.tta_shift or self.tta, "--tta-shift needs --tta"),
            (0 <= self.ema < 1, f"--ema must be a decay in [0, 1), got {self.ema}"),
            (self.ghost_batch == 0 or self.ghost_batch >= 2,
             f"--ghost-batch must be 0 (off) or >= 2 images, got {self.ghost_batch}"),
            (self.bucket_mb > 0, f"--bucket-mb must be > 0, got {self.bucket_mb}"),
            (not self.tune_kernels or self.compile != "none",
             "--tune-kernels tunes the kernels torch.compile generates: add --compile default"),
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
            raise ConfigError(
                f"global --batch {self.batch} is not divisible by {world_size} processes; "
                f"use a multiple of {world_size}, or --scaling weak"
            )
        per_gpu = self.batch if self.scaling == "weak" else self.batch // world_size
        if self.ghost_batch and per_gpu % self.ghost_batch:
            raise ConfigError(
                f"the batch of each process ({per_gpu}) is not a multiple of --ghost-batch "
                f"{self.ghost_batch}; pick a divisor of it"
            )
        return per_gpu, per_gpu * world_size

    def peak_lr(self, world_size: int) -> float:
        return self.lr * self.batches(world_size)[1] / REFERENCE_BATCH


def lr_factor(cfg: TrainConfig, step: int, steps_per_epoch: int) -> float:
    """Multiplier of the peak learning rate at optimizer step ``step``."""
    epoch = step / steps_per_epoch
    if cfg.schedule == "step":
        return 0.2 ** sum(epoch >= f * cfg.epochs for f in (0.3, 0.6, 0.8))
    warmup = max(cfg.warmup_epochs, 1e-9)
    if epoch < warmup:
        return (epoch + 1 / steps_per_epoch) / warmup
    return max(0.0, (cfg.epochs - epoch) / max(cfg.epochs - warmup, 1e-9))


def param_groups(net: torch.nn.Module, weight_decay: float,
                 decay_all: bool = True) -> list[dict]:
    """SGD parameter groups: every tensor decayed, or only the weight matrices and kernels.

    Without ``decay_all``, one-dimensional tensors (BatchNorm scales and shifts, biases) get no
    weight decay: they set the scale of a layer's output, which decay would only shrink.
    """
    params = list(net.parameters())
    if decay_all:
        return [{"params": params, "weight_decay": weight_decay}]
    return [{"params": [p for p in params if p.ndim > 1], "weight_decay": weight_decay},
            {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}]


@dataclass
class Trainer:
    cfg: TrainConfig
    ctx: DistContext
    data: Cifar10
    model: torch.nn.Module = field(init=False)
    start_epoch: int = 0

    def __post_init__(self) -> None:
        cfg, ctx = self.cfg, self.ctx
        self.per_gpu, self.global_batch = cfg.batches(ctx.world_size)
        torch.manual_seed(cfg.seed)
        fmt = torch.channels_last if cfg.channels_last else torch.contiguous_format
        self.net = WideResNet(cfg.depth, cfg.width, dropout=cfg.dropout)
        if cfg.ghost_batch:
            convert_ghost_batchnorm(self.net, cfg.ghost_batch)
        self.net.to(ctx.device, memory_format=fmt)
        # With --step-graph, forward and backward are recorded by warm_up() into one CUDA
        # graph; DDP must be built on the stream that records it.
        self.graph = StepGraph(ctx.device, enabled=cfg.step_graph)
        self._replay = None  # set by warm_up(): replays the graph, reading these two tensors
        self.static_x: torch.Tensor | None = None
        self.static_y: torch.Tensor | None = None
        with self.graph.stream():
            # Compiled inside DDP: with "reduce-overhead" forward and backward become CUDA
            # graphs and DDP all-reduces the gradients once the compiled backward produced them.
            tuning = DDPTuning(cfg.bucket_mb, cfg.bucket_view, cfg.bf16_grads)
            self.model = tuning.wrap(compile_for_ddp(self.net, cfg.compile, ctx), ctx)
        # The average lives beside the network, uncompiled, and is what evaluate() tests.
        self.ema = AveragedModel(self.net, multi_avg_fn=get_ema_multi_avg_fn(cfg.ema),
                                 use_buffers=True) if cfg.ema else None
        self.train_loader = self._train_loader()
        self.steps_per_epoch = len(self.train_loader)
        # fused: on a GPU, decay, momentum and update in one pass over the tensors, not three
        self.optimizer = torch.optim.SGD(
            param_groups(self.net, cfg.weight_decay, cfg.norm_weight_decay),
            lr=cfg.peak_lr(ctx.world_size), momentum=cfg.momentum, nesterov=cfg.nesterov,
            fused=ctx.device.type == "cuda" or None)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(cfg, s, self.steps_per_epoch))
        self.test_loader = DeviceLoader(self.data.test_x, self.data.test_y, 500,
                                        device=ctx.device, rank=ctx.rank,
                                        world_size=ctx.world_size, train=False,
                                        channels_last=cfg.channels_last)

    def _train_loader(self):
        cfg, ctx, d = self.cfg, self.ctx, self.data
        if cfg.loader == "device":
            return DeviceLoader(d.train_x, d.train_y, self.per_gpu, device=ctx.device,
                                rank=ctx.rank, world_size=ctx.world_size, seed=cfg.seed,
                                channels_last=cfg.channels_last, crop_pad=cfg.crop_pad)
        return dataloader(d.train_x, d.train_y, self.per_gpu, rank=ctx.rank,
                          world_size=ctx.world_size, seed=cfg.seed, workers=cfg.workers,
                          pin_memory=ctx.device.type == "cuda", crop_pad=cfg.crop_pad)

    @property
    def checkpoint_path(self) -> Path:
        return self.cfg.out / "checkpoint.pt"

    def save(self, epoch: int) -> None:
        save_checkpoint(self.checkpoint_path, {
            "model": self.net.state_dict(), "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(), "rng": rng_state(self.ctx.device),
            "epoch": epoch, "config": to_dict(self.cfg), "world_size": self.ctx.world_size,
            "ema": self.ema.state_dict() if self.ema else None,
        })

    def restore(self) -> None:
        keys = ("depth", "width", "batch", "scaling", "seed", "epochs", "schedule",
                "norm_weight_decay", "ema", "ghost_batch")
        state = load_checkpoint(self.checkpoint_path, {k: getattr(self.cfg, k) for k in keys})
        self.net.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.ema:
            self.ema.load_state_dict(state["ema"])
        set_rng_state(state["rng"], self.ctx.device)
        self.start_epoch = state["epoch"] + 1

    def train_one_epoch(self, epoch: int) -> dict[str, float]:
        cfg, dev = self.cfg, self.ctx.device
        self.model.train()
        loader = self.train_loader
        (loader.set_epoch if cfg.loader == "device" else loader.sampler.set_epoch)(epoch)
        loss_sum = torch.zeros((), device=dev)
        correct = torch.zeros((), device=dev, dtype=torch.long)
        seen = 0
        synchronize(dev)
        t0 = time.perf_counter()
        first_step = epoch * self.steps_per_epoch
        for i, (x, y) in enumerate(_progress(loader, self.ctx, epoch, cfg.epochs)):
            if cfg.crash_at_step == first_step + i:
                self._simulated_crash(first_step + i)
            x, y = self._on_device(x, y)
            out, loss = self.forward_backward(x, y)
            self.optimizer.step()
            self.scheduler.step()
            if self.ema:
                self.ema.update_parameters(self.net)
            # Accumulate on the device: a .item() per step would stall the GPU queue.
            loss_sum += loss.detach() * len(y)
            correct += (out.argmax(1) == y).sum()
            seen += len(y)
        synchronize(dev)
        seconds = time.perf_counter() - t0
        loss_total, correct_total, n = all_reduce_sum(self.ctx, loss_sum.item(),
                                                      correct.item(), seen)
        return {"epoch_time_s": seconds, "images_per_s": n / seconds,
                "train_loss": loss_total / n, "train_acc": correct_total / n}

    def _on_device(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if x.dtype == torch.uint8:  # DataLoader batches arrive as bytes on the host
            dev = self.ctx.device
            x = normalize(x.to(dev, non_blocking=True), self.cfg.channels_last)
            y = y.to(dev, non_blocking=True)
        return x, y

    def forward_backward(self, x: torch.Tensor,
                         y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Outputs and loss of one batch, its gradients left for the optimizer."""
        if self._replay is None:
            return self._forward_backward(x, y)
        self.static_x.copy_(x)  # the graph reads its batch from these
        self.static_y.copy_(y)
        return self._replay()

    def _forward_backward(self, x: torch.Tensor,
                          y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        # No autocast cache: a cached bf16 copy of a weight would be freed at the end of the
        # region while a recorded graph still reads it (each weight is used once anyway).
        with torch.autocast(self.ctx.device.type, dtype=torch.bfloat16, enabled=cfg.bf16,
                            cache_enabled=False):
            out = self.model(x)
            loss = F.cross_entropy(out, y, label_smoothing=cfg.label_smoothing)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        return out, loss

    def warm_up(self, steps: int = 3) -> float:
        """Compile the step (and capture its CUDA graphs) before the clock starts; seconds taken.

        Runs forward and backward on the first batch ``steps`` times (with ``--step-graph``:
        the warm-up steps the capture needs, then the capture), without an optimizer step,
        then puts back the weights, BatchNorm statistics and random generators: the training
        that follows is the one it would have been without the warm-up.
        """
        dev = self.ctx.device
        saved = {k: v.clone() for k, v in self.net.state_dict().items()}
        rng = rng_state(dev)
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
        set_rng_state(rng, dev)
        synchronize(dev)
        return time.perf_counter() - t0

    def _simulated_crash(self, step: int) -> None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if self.ctx.rank == self.ctx.world_size - 1 and first_attempt:
            print(f"rank {self.ctx.rank}: simulated crash at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no checkpoint: a real crash

    @torch.no_grad()
    def evaluate(self) -> float:
        model = self.ema.module if self.ema else self.model
        model.eval()
        correct = torch.zeros((), device=self.ctx.device, dtype=torch.long)
        seen = 0
        for x, y in self.test_loader:
            with torch.autocast(self.ctx.device.type, dtype=torch.bfloat16, enabled=self.cfg.bf16):
                out = predict(model, x, self.cfg.tta, self.cfg.tta_shift)
                correct += (out.argmax(1) == y).sum()
            seen += len(y)
        total_correct, n = all_reduce_sum(self.ctx, correct.item(), seen)
        return total_correct / n


def predict(model: torch.nn.Module, x: torch.Tensor, tta: bool = False,
            shift: int = 0) -> torch.Tensor:
    """Logits for ``x``; with ``tta``, plus the logits of its mirror image, and with ``shift``
    also those of both views moved ``shift`` pixels up-left and down-right, at half weight."""
    out = model(x)
    if not tta:
        return out
    # A CUDA-graph replay returns the same output memory every time: keep the first result.
    out = out.clone()
    mirror = torch.flip(x, dims=[3])
    out += model(mirror)
    for view in (x, mirror) if shift else ():
        for s in (shift, -shift):
            out += 0.5 * model(translate(view, s))
    return out


def translate(x: torch.Tensor, shift: int) -> torch.Tensor:
    """``x`` moved ``shift`` pixels down-right (up-left when negative), edges mirrored."""
    s = abs(shift)
    padded = F.pad(x, (s, s, s, s), mode="reflect")
    start = s - shift  # the window of the padded image that holds the moved one
    h, w = x.shape[-2:]
    fmt = (torch.channels_last if x.is_contiguous(memory_format=torch.channels_last)
           else torch.contiguous_format)  # a compiled network expects the layout it was given
    return padded[..., start:start + h, start:start + w].contiguous(memory_format=fmt)


def _progress(loader, ctx: DistContext, epoch: int, epochs: int):
    if not ctx.is_main or not sys.stderr.isatty():
        return loader
    from tqdm import tqdm

    return tqdm(loader, desc=f"epoch {epoch + 1}/{epochs}", leave=False, file=sys.stderr)


def _load_data(cfg: TrainConfig, ctx: DistContext) -> Cifar10:
    def load() -> Cifar10:
        return load_cifar10(cfg.data, cfg.data_dir, cfg.download,
                            limit_per_class=cfg.limit_per_class)

    if ctx.is_main:  # decode/download once; the others then read the cache
        data = load()
    ctx.barrier()
    return data if ctx.is_main else load()


def _log(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def run(cfg: TrainConfig, ctx: DistContext) -> list[dict]:
    """Train; return the per-epoch records (rank 0 also writes them to metrics.jsonl)."""
    if ctx.device.type == "cuda":
        # Fixed shapes: let cuDNN time its kernels once and keep the fastest, unless the run
        # must repeat exactly (the fastest kernels may sum in a different order each time).
        torch.backends.cudnn.benchmark = not cfg.deterministic
        torch.backends.cuda.matmul.allow_tf32 = True
    if cfg.compile != "none":
        from torch._inductor import config as inductor_config

        inductor_config.coordinate_descent_tuning = cfg.tune_kernels  # process-wide
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts
        torch.use_deterministic_algorithms(True, warn_only=True)
    data = _load_data(cfg, ctx)
    trainer = Trainer(cfg, ctx, data)
    if cfg.resume and trainer.checkpoint_path.exists():
        trainer.restore()
    with trainer.graph:  # a recorded graph is released before the process group goes
        return _train(cfg, ctx, data, trainer)


def _train(cfg: TrainConfig, ctx: DistContext, data: Cifar10, trainer: Trainer) -> list[dict]:
    from .stamp import environment_stamp

    warmup_s = trainer.warm_up() if cfg.compile != "none" or cfg.step_graph else 0.0
    metrics = cfg.out / "metrics.jsonl"
    if ctx.is_main:
        cfg.out.mkdir(parents=True, exist_ok=True)
        if trainer.start_epoch == 0:
            metrics.unlink(missing_ok=True)
        _log(metrics, {
            "event": "start", "config": to_dict(cfg), "data": data.name,
            "synthetic_data": data.synthetic, "world_size": ctx.world_size,
            "per_gpu_batch": trainer.per_gpu, "global_batch": trainer.global_batch,
            "peak_lr": cfg.peak_lr(ctx.world_size), "start_epoch": trainer.start_epoch,
            "compile_warmup_s": warmup_s,
            "stamp": environment_stamp().as_dict(),
        })
        if data.synthetic:
            print(f"WARNING: training on {data.name} data, not CIFAR-10", file=sys.stderr)
    records = []
    for epoch in range(trainer.start_epoch, cfg.epochs):
        record = {"event": "epoch", "epoch": epoch + 1, **trainer.train_one_epoch(epoch),
                  "test_acc": trainer.evaluate(), "lr": trainer.scheduler.get_last_lr()[0]}
        records.append(record)
        if ctx.is_main:
            _log(metrics, record)
            print(f"epoch {epoch + 1:3d}/{cfg.epochs}  {record['epoch_time_s']:6.2f} s  "
                  f"{record['images_per_s']:8.0f} img/s  loss {record['train_loss']:.3f}  "
                  f"train {record['train_acc']:.2%}  test {record['test_acc']:.2%}", flush=True)
            last = epoch + 1 == cfg.epochs
            if cfg.checkpoint_every and ((epoch + 1) % cfg.checkpoint_every == 0 or last):
                trainer.save(epoch)
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
