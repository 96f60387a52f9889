"""Measurements made on more GPUs than a reader may have: dated records under ``book/data``.

A record is one JSON-lines file, ``book/data/<name>.jsonl``: a header line (what was measured,
the command that remakes it, its configuration, the environment stamp with the commit and the
date, and a hash of every package module the measurement ran), then one line per measured row.
A chapter reads the record where there is one and measures on the machine at hand where there is
none (:func:`read_or_measure`); either way it prints where its numbers come from. For a record,
that line also says which of the modules it ran have changed since, computed when it is read: a
record is dated, never silently stale. ``make records`` remakes every record, one command per
chapter (each benchmark's ``--record``).
"""

from __future__ import annotations

import hashlib
import importlib
import shlex
import sys
import textwrap
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..config import to_dict
from ..jsonl import read_jsonl, write_jsonl

PACKAGE = Path(__file__).resolve().parents[1]
ROOT = PACKAGE.parents[1] / "book" / "data"  # the book's records, beside its chapters


def module_file(module: str, package_root: Path = PACKAGE) -> Path:
    """Source file of a ``tutorial_utils[.sub...]`` module inside ``package_root``."""
    base = package_root.joinpath(*module.split(".")[1:])
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def module_hashes(modules: Iterable[str], package_root: Path = PACKAGE) -> dict[str, str]:
    """sha256 of each module's source ("missing" for a module that no longer exists)."""
    out = {}
    for m in sorted(set(modules)):
        f = module_file(m, package_root)
        out[m] = hashlib.sha256(f.read_bytes()).hexdigest() if f.exists() else "missing"
    return out


@dataclass(frozen=True)
class Source:
    """Where a chapter's numbers come from: a record, or a measurement on this machine."""

    text: str  # for the cell's output
    hardware: str  # for figure titles, such as "2 x NVIDIA H200"
    config: dict  # the configuration measured (the record's, or the one measured here)
    made: str  # for the prose: "a record made on 2 x NVIDIA H200 on 2026-11-30"

    def __str__(self) -> str:
        return self.text


@dataclass
class Record:
    name: str
    header: dict
    rows: list[dict]

    def changed_modules(self, package_root: Path = PACKAGE) -> list[str]:
        """The modules the measurement ran whose source differs now (or no longer exists)."""
        then = self.header.get("modules", {})
        now = module_hashes(then, package_root)
        return [m for m, h in now.items() if then[m] != h]

    @property
    def hardware(self) -> str:
        stamp = self.header["stamp"]
        return (f"{stamp['gpu_count']} x {stamp['gpu_names'][0]}" if stamp["gpu_count"]
                else f"CPU only ({stamp.get('cpu_model', stamp['cpu'])})")

    def describe(self) -> str:
        """Where, when and by what the numbers were measured, and what changed since."""
        stamp, source = self.header["stamp"], self.header.get("source")
        lines = [f"Record {self.name}: measured on {self.hardware}, {stamp['date_utc']} UTC, "
                 f"commit {stamp['git_commit']}" + (f" ({source})" if source else "") + ".",
                 f"Remade by: {self.header['command']}"]
        changed, total = self.changed_modules(), len(self.header.get("modules", {}))
        if not total:
            lines.append("The modules it ran were not recorded; its source names their commit.")
        else:
            lines.append(f"Modules it ran that changed since: {len(changed)} of {total}"
                         + (f" ({', '.join(m.removeprefix('tutorial_utils.') for m in changed)})"
                            if changed else "") + ".")
        return "\n".join(textwrap.fill(line, 96, subsequent_indent="  ") for line in lines)


def path_of(name: str, root: Path | None = None) -> Path:
    return (root or ROOT) / f"{name}.jsonl"


def load(name: str, root: Path | None = None) -> Record | None:
    """The record ``name``, or None where there is none (a fresh machine, an installed package)."""
    lines = read_jsonl(path_of(name, root))
    if not lines or lines[0].get("event") != "record":
        return None
    return Record(name, lines[0], lines[1:])


def write(name: str, cfg, rows: Sequence[dict], program: str,
          workers: Sequence[str] = (), root: Path | None = None) -> Path:
    """Replace the record ``name`` with ``rows`` measured by ``program`` (a module) with
    ``cfg``; ``workers`` are the modules it launched, hashed with everything it imported."""
    from ..stamp import environment_stamp

    for worker in workers:  # imported here only to be hashed: their code made the rows too
        importlib.import_module(worker)
    mine = [m for m in sys.modules if m.split(".")[0] == "tutorial_utils"]
    header = {"event": "record", "name": name, "command": command(program, cfg),
              "config": to_dict(cfg), "stamp": environment_stamp().as_dict(),
              "modules": module_hashes(mine)}
    path = path_of(name, root)
    path.unlink(missing_ok=True)
    write_jsonl(path, [header, *rows])
    return path


def write_part(name: str, cfg, rows: Sequence[dict], order: Sequence[str], program: str,
               workers: Sequence[str] = (), root: Path | None = None) -> tuple[Path, int]:
    """Write some runs of a sweep (rows labelled by ``run``) to the record ``name``, keeping the
    other runs of the record already there if it was made with the same configuration, the same
    commit and the same module sources; else the record holds these runs only. The runs stand
    in ``order``. Returns the path and how many runs were kept."""
    from ..stamp import environment_stamp

    for worker in workers:
        importlib.import_module(worker)
    mine = [m for m in sys.modules if m.split(".")[0] == "tutorial_utils"]
    old, new = load(name, root), {r["run"] for r in rows}
    same = (old is not None and old.header["config"] == to_dict(cfg)
            and old.header["stamp"]["git_commit"] == environment_stamp().git_commit
            and old.header["modules"] == module_hashes(old.header["modules"])
            and set(old.header["modules"]) <= set(mine))
    kept = [r for r in old.rows if r["run"] not in new] if same else []
    rank = {label: i for i, label in enumerate(order)}
    combined = sorted([*kept, *rows], key=lambda r: rank.get(r["run"], len(rank)))  # stable
    path = write(name, cfg, combined, program, workers, root)
    return path, len({r["run"] for r in kept})


def command(program: str, cfg) -> str:
    """The command line that remakes a record: the program and its non-default options."""
    return shlex.join(["python", "-m", program, *cfg.to_argv()])


def read_or_measure(name: str, measure: Callable[[], list[dict]],
                    cfg=None) -> tuple[list[dict], Source]:
    """The rows of the record ``name`` if there is one, else ``measure()``'s (with ``cfg``);
    and a :class:`Source` that says which."""
    from ..stamp import environment_stamp

    record = load(name)
    if record is not None:
        made = (f"a record made on {record.hardware} on "
                f"{record.header['stamp']['date_utc'].split()[0]}")
        return record.rows, Source(record.describe(), record.hardware, record.header["config"],
                                   made)
    rows, hardware = measure(), environment_stamp().hardware
    text = (f"No record {name} yet: measured here, on {hardware} (`make records` makes the "
            "record on a machine with the GPUs it needs).")
    return rows, Source(text, hardware, to_dict(cfg) if cfg is not None else {},
                        f"this machine ({hardware})")
