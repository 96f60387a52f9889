"""Typed, validated configuration: one dataclass per program, its command line generated.

Every program of the package (the training entry point, the workers torchrun starts, the
benchmarks) is configured the same way. A dataclass declares its settings with :func:`opt` (a
default and a ``--help`` text) and checks them in ``__post_init__``, raising
:class:`ConfigError` with a message a person understands. :func:`parse` builds the command line
from the fields; :meth:`Config.to_argv` writes a configuration back as the options that rebuild
it, so a launcher hands ``cfg.to_argv()`` to the process it starts and both sides share one
definition of every setting.

    @dataclass
    class StepConfig(Config):
        batch: int = opt(128, "images per process")

    cfg = parse(StepConfig, ["--batch", "64"], prog="step")  # StepConfig(batch=64)
    cfg.to_argv()                                             # ["--batch", "64"]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import typing
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any, Literal


class ConfigError(ValueError):
    """An invalid setting; the message says which and what to use instead."""


def opt(default: Any = MISSING, doc: str = "") -> Any:
    """A configuration field with its ``--help`` text; no default makes the option required."""
    return field(default=default, metadata={"help": doc})


def check(*rules: tuple[bool, str]) -> None:
    """Raise :class:`ConfigError` with the message of the first rule that does not hold."""
    for ok, message in rules:
        if not ok:
            raise ConfigError(message)


def check_wrn(name: str, flag: str = "--model") -> None:
    """Raise :class:`ConfigError` unless ``name`` names a Wide-ResNet, such as ``wrn-28-10``."""
    from .models.wrn import wrn_shape

    try:
        wrn_shape(name)
    except ValueError as err:
        raise ConfigError(f"{flag}: {err}") from None


def check_gpus(n: int, flag: str, cpu: str, fewest: int = 1) -> None:
    """Raise :class:`ConfigError` if ``flag`` asks for ``n`` GPUs and this machine has fewer.

    The message says how many there are and what to use instead: ``flag`` with that many (if
    that is at least ``fewest``, the option's minimum), a larger machine, or ``cpu``.
    """
    from .devices import gpu_count

    have = gpu_count()
    if n > have:
        fewer = f"{flag} {have}, " if have >= fewest else ""
        raise ConfigError(f"{flag} {n}: asked for {n} GPU(s) but this machine has {have}; use "
                          f"{fewer}a machine with {n} GPUs, or {cpu}")


class Config:
    """Base of the configuration dataclasses: ``cfg.to_argv()`` writes ``cfg`` as options."""

    def to_argv(self) -> list[str]:
        """The command-line options that give this configuration (the non-default ones)."""
        return to_argv(self)


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad option is one line on stderr (exit 2) instead of usage + error."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _option(parser: argparse.ArgumentParser, f: dataclasses.Field, hint: Any) -> None:
    required = f.default is MISSING
    help_text = f.metadata.get("help", "")
    kwargs: dict[str, Any] = {"help": help_text if required else f"{help_text} (default: "
                              "%(default)s)"}
    if required:
        kwargs["required"] = True
    else:
        kwargs["default"] = f.default
    # `X | None` is an X that may be left unset
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    base = args[0] if typing.get_origin(hint) is not Literal and len(args) == 1 else hint
    origin = typing.get_origin(base)
    if base is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif origin is Literal:
        kwargs["choices"] = typing.get_args(base)
    elif origin is tuple:  # tuple[int, ...]: any number of values after the flag
        item = typing.get_args(base)[0]
        kwargs |= {"nargs": "*", "type": item}
        if typing.get_origin(item) is Literal:
            kwargs |= {"type": str, "choices": typing.get_args(item)}
    else:
        kwargs["type"] = base
    parser.add_argument(_flag(f.name), **kwargs)


def build_parser(cls: type, prog: str, description: str | None = None) -> argparse.ArgumentParser:
    """One ``--option`` per dataclass field, typed from its annotation."""
    doc = description or (cls.__doc__ or "").strip().splitlines()[0]
    parser = OneLineParser(prog=prog, description=doc)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        _option(parser, f, hints[f.name])
    return parser


def parse(cls: type, argv: list[str] | None, prog: str, description: str | None = None):
    """Parse ``argv`` (default: ``sys.argv[1:]``) into ``cls``; ConfigError on bad values."""
    ns = build_parser(cls, prog, description).parse_args(sys.argv[1:] if argv is None else argv)
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in vars(ns).items()}
    return cls(**values)


def parse_or_exit(cls: type, argv: list[str] | None, module: str,
                  machine: Callable[[Any], None] | None = None):
    """:func:`parse` for ``python -m module``; an invalid setting ends it with one line (exit 2).

    ``machine(cfg)``, if given, then checks what needs this machine (enough GPUs), and ends the
    program the same way, before any work.
    """
    prog = f"python -m {module}"
    try:
        cfg = parse(cls, argv, prog)
        if machine is not None:
            machine(cfg)
        return cfg
    except ConfigError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def to_dict(cfg: Any) -> dict[str, Any]:
    """JSON- and checkpoint-safe: paths become strings, tuples lists."""
    def plain(v: Any) -> Any:
        return str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v

    return {k: plain(v) for k, v in dataclasses.asdict(cfg).items()}


def to_argv(cfg: Any) -> list[str]:
    """Command-line options that rebuild ``cfg``: one per field that differs from its default."""
    argv: list[str] = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.default is not MISSING and value == f.default:
            continue
        name = _flag(f.name)
        if isinstance(value, bool):
            argv.append(name if value else "--no-" + name[2:])
        elif isinstance(value, tuple | list):
            argv += [name, *map(str, value)]
        elif value is not None:
            argv += [name, str(value)]
    return argv


# --- The training entry point's configuration -------------------------------------------------

REFERENCE_BATCH = 128  # the batch the base learning rate is given for


@dataclass
class TrainConfig(Config):
    """Train a Wide-ResNet on CIFAR-10: one entry point for a CPU, one GPU, or N under torchrun."""

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
    precision: Literal["bf16", "fp16", "fp32"] = opt(
        "bf16", "bf16 autocast; fp16 autocast with a gradient scaler, for GPUs without bf16; "
        "or fp32 throughout")
    grad_accum: int = opt(1, "compute each process's batch as K micro-batches, all-reduced "
                          "once (DDP's no_sync): less activation memory, the same step")
    clip_norm: float | None = opt(None, "clip the gradients to this global L2 norm, after "
                                  "the all-reduce (the same on every rank)")
    sync_bn: bool = opt(False, "SyncBatchNorm: BatchNorm statistics over every process's "
                        "batch, not each process's own")
    ghost_bn: int | None = opt(None, "BatchNorm statistics over groups of this many images of "
                               "each batch: what that many images per GPU give without "
                               "--sync-bn, shown on one GPU")
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
        """The linear scaling rule (Goyal et al.): the rate grows with the global batch."""
        return self.lr * self.batches(world_size)[1] / REFERENCE_BATCH


# Options added after runs were recorded: an older checkpoint or record trained with these values.
ADDED_LATER = {"grad_accum": 1, "clip_norm": None, "sync_bn": False, "ghost_bn": None}


def saved_train_config(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved :class:`TrainConfig` dict in today's fields: before ``--precision`` existed, runs
    said ``bf16: true`` (autocast) or ``false`` (fp32), and none had the options in ADDED_LATER."""
    new = {**ADDED_LATER, **saved}
    if "bf16" in new:
        bf16 = new.pop("bf16")
        new.setdefault("precision", "bf16" if bf16 else "fp32")
    return new
