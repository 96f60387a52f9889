"""Typed, validated configuration: one dataclass per program, its command line generated.

Every program of the package (the training entry point, the workers torchrun starts, the
benchmarks) is configured the same way. A dataclass declares its settings with :func:`opt` (a
default and a ``--help`` text) and checks them in ``__post_init__``, raising
:class:`ConfigError` with a message a person understands. :func:`parse` builds the command line
from the fields; :meth:`Config.to_argv` writes a configuration back as the options that rebuild
it, so a launcher hands ``cfg.to_argv()`` to the process it starts and both sides share one
definition of every setting. This module holds the mechanism only: each dataclass lives beside
the program it configures (the training entry point's in :mod:`tutorial_utils.trainer`).

    @dataclass
    class StepConfig(Config):
        batch: int = opt(128, "images per process")

    cfg = parse(StepConfig, ["--batch", "64"], prog="step")  # StepConfig(batch=64)
    cfg.to_argv()                                             # ["--batch", "64"]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from collections.abc import Callable
from dataclasses import MISSING, field
from pathlib import Path
from typing import Any, Literal


class ConfigError(ValueError):
    """An invalid setting; the message says which and what to use instead."""


def opt(default: Any = MISSING, doc: str = "", **metadata: Any) -> Any:
    """A configuration field with its ``--help`` text; no default makes the option required.

    Other keywords go into the field's metadata, for the program that reads them
    (:mod:`tutorial_utils.trainer` records there what a resume does with each setting).
    """
    return field(default=default, metadata={"help": doc, **metadata})


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
