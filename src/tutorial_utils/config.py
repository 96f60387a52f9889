"""Typed, validated configuration, and a command line generated from it."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from pathlib import Path
from typing import Any, Literal


class ConfigError(ValueError):
    """An invalid setting; the message says which and what to use instead."""


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad option is one line on stderr (exit 2) instead of usage + error."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _option(parser: argparse.ArgumentParser, f: dataclasses.Field, hint: Any) -> None:
    name = "--" + f.name.replace("_", "-")
    help_text = f.metadata.get("help", "")
    kwargs: dict[str, Any] = {"default": f.default, "help": f"{help_text} (default: %(default)s)"}
    origin = typing.get_origin(hint)
    if hint is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif origin is Literal:
        kwargs["choices"] = typing.get_args(hint)
    else:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        kwargs["type"] = args[0] if origin is not None and args else hint
    parser.add_argument(name, **kwargs)


def build_parser(cls: type, prog: str, description: str) -> argparse.ArgumentParser:
    """One ``--option`` per dataclass field, typed from its annotation."""
    parser = OneLineParser(prog=prog, description=description)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        _option(parser, f, hints[f.name])
    return parser


def parse(cls: type, argv: list[str] | None, prog: str, description: str):
    """Parse ``argv`` into ``cls`` (its ``__post_init__`` validates); ConfigError on bad values."""
    ns = build_parser(cls, prog, description).parse_args(sys.argv[1:] if argv is None else argv)
    return cls(**vars(ns))


def to_dict(cfg: Any) -> dict[str, Any]:
    """JSON- and checkpoint-safe: paths become strings."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(cfg).items()}


def to_argv(cfg: Any) -> list[str]:
    """Command-line options that rebuild ``cfg``: one per field that differs from its default."""
    argv: list[str] = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if value == f.default:
            continue
        name = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(name if value else "--no-" + f.name.replace("_", "-"))
        else:
            argv += [name, str(value)]
    return argv
