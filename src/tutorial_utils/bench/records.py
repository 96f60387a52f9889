"""GPU measurements as dated records under ``book/data``; everything else runs live.

A chapter runs its correctness demonstrations on the machine that executes it (CPU processes
where GPUs are missing), but every number it shows that was measured on a GPU comes from a
*record*: one JSON-lines file, ``book/data/<name>.jsonl``, whose header says what was measured,
on how many GPUs, the command that remakes it, its configuration, the environment stamp (the
machine, the commit, the date), a hash of every package module the measurement ran, and how
many rows follow. So any machine, a laptop included, can execute the whole book, and each
record's cell says where and when it was measured and which of its modules changed since.

:func:`measured` is what a chapter calls. It returns the record's rows, or, with
``TUTORIAL_MEASURE=1`` on a machine with the GPUs the record needs, rows measured there, printed
beside the record's. ``make records`` remakes the records, one command per chapter (each
benchmark's ``--record``). A record is written atomically and refused on load when torn.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shlex
import sys
import textwrap
import typing
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, is_dataclass
from pathlib import Path

from ..config import to_dict
from ..jsonl import read_jsonl, rewrite_jsonl

PACKAGE = Path(__file__).resolve().parents[1]
ROOT = PACKAGE.parents[1] / "book" / "data"  # the book's records, beside its chapters
MEASURE_ENV = "TUTORIAL_MEASURE"  # "1": measure on this machine instead of reading records
LOG_ENV = "TUTORIAL_MODULE_LOG"  # where the book's executor collects what a chapter used


class RecordError(RuntimeError):
    """A record cannot be written or read as asked; the message says what to do instead."""


def measuring() -> bool:
    """Whether the reader asked the chapters to measure this machine (``TUTORIAL_MEASURE=1``)."""
    return os.environ.get(MEASURE_ENV, "").strip() == "1"


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


def _gpus(n: int) -> str:
    return f"{n} GPU" + ("" if n == 1 else "s")


@dataclass(frozen=True)
class Source:
    """Where a chapter's numbers come from: a record, or a measurement on this machine."""

    text: str  # for the cell's output
    hardware: str  # for figure titles, such as "2 x NVIDIA H200"
    config: dict  # the configuration measured (the record's, or the one measured here)
    made: str  # for the prose: "a record made on 2 x NVIDIA H200 on 2026-11-30"
    here: bool = False  # measured on this machine while the chapter ran
    stamp: dict | None = None  # the environment stamp of the machine that measured

    def __str__(self) -> str:
        return self.text

    def gpu_memory(self) -> int | None:
        """Bytes of memory of the first GPU that measured (None: no GPU measured)."""
        gib = (self.stamp or {}).get("gpu_memory_gib") or []
        return round(gib[0] * 2**30) if gib else None


@dataclass
class Record:
    name: str
    header: dict
    rows: list[dict]

    @property
    def gpus(self) -> int:
        """The GPUs the measurement needs (and the machine that made it had)."""
        return self.header.get("gpus", self.header["stamp"]["gpu_count"])

    @property
    def date(self) -> str:
        return self.header["stamp"]["date_utc"].split()[0]

    @property
    def commit(self) -> str:
        return self.header["stamp"]["git_commit"]

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

    def changed_text(self) -> str:
        """Which of the modules it ran changed since, as the cell prints it."""
        changed, total = self.changed_modules(), len(self.header.get("modules", {}))
        if not total:
            return ("Code changed since: not known (the record was made before records kept the "
                    "modules they ran).")
        names = [m.removeprefix("tutorial_utils.") for m in changed]
        shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
        return (f"Code changed since: {len(changed)} of the {total} modules it ran"
                + (f" ({shown})" if changed else "") + ".")

    @property
    def machine(self) -> str:
        """The hardware and the PyTorch it ran: "1 x NVIDIA H100 (torch 2.11.0)"."""
        return f"{self.hardware} (torch {self.header['stamp']['torch'].split('+')[0]})"

    def describe(self, short: bool = False) -> str:
        """Where, when and by what the numbers were measured, and what changed since; ``short``:
        one line, for a record of a run the chapter described already."""
        made_from = " (made from a chapter's stored output)" if self.header.get("source") else ""
        if short:
            return textwrap.fill(f"Record {self.name}: the same run, {self.machine}, {self.date}, "
                                 f"commit {self.commit}{made_from}.", 96, subsequent_indent="  ")
        lines = [f"Record {self.name}: measured on {self.machine}, {self.date}, commit "
                 f"{self.commit}{made_from}.", f"Remade by: {self.header['command']}",
                 self.changed_text()]
        return "\n".join(textwrap.fill(line, 96, subsequent_indent="  ") for line in lines)

    def typed(self, row_type: type) -> list:
        """The rows as ``row_type`` (the dataclass the measurement wrote)."""
        return [from_row(row_type, r) for r in self.rows]


def path_of(name: str, root: Path | None = None) -> Path:
    return Path(root or ROOT) / f"{name}.jsonl"


def _log_read(path: Path) -> None:
    """Tell the book's executor that the chapter read this record (for its stale check)."""
    if log := os.environ.get(LOG_ENV):
        try:
            with open(log, "a") as f:
                f.write(json.dumps([f"record:{path.resolve()}"]) + "\n")
        except OSError:
            pass  # the log must never break the chapter it watches


def load(name: str, root: Path | None = None) -> Record | None:
    """The record ``name``, or None where there is none (a fresh machine, an installed package).

    A record whose rows do not number what its header says (a copy cut short) is refused.
    """
    path = path_of(name, root)
    _log_read(path)  # a record still missing is logged too: once made, the chapter is stale
    try:
        lines = read_jsonl(path)
    except ValueError as err:
        raise RecordError(f"{err}: the record is damaged; restore it (git checkout {path.name})"
                          " or remake it (make records)") from None
    if not lines or lines[0].get("event") != "record":
        return None
    header, rows = lines[0], lines[1:]
    if "rows" in header and header["rows"] != len(rows):
        raise RecordError(f"{path} holds {len(rows)} of its {header['rows']} rows: it is torn; "
                          f"restore it (git checkout) or remake it: {header['command']}")
    return Record(name, header, rows)


def as_row(row) -> dict:
    """A row for a record: a dataclass's fields (JSON-safe), or a dict as it is."""
    return to_dict(row) if is_dataclass(row) else dict(row)


def from_row(row_type: type, row: dict):
    """``row_type`` rebuilt from a record's row (a dataclass field from its dict, a tuple from
    its list); fields it does not know are an error."""
    hints = typing.get_type_hints(row_type)
    if unknown := set(row) - set(hints):
        raise RecordError(f"a row of fields {sorted(unknown)} is not a {row_type.__name__}: "
                          "the record was made by other code; remake it (make records)")
    return row_type(**{k: _typed(hints[k], v) for k, v in row.items()})


def _typed(hint, value):
    kinds = [hint, *typing.get_args(hint)]
    if isinstance(value, dict) and (inner := next((k for k in kinds if is_dataclass(k)), None)):
        return from_row(inner, value)
    if isinstance(value, list) and any(typing.get_origin(k) is tuple for k in kinds):
        return tuple(value)
    return value


def _header(name: str, cfg, program: str, workers: Sequence[str], gpus: int, what: str,
            n_rows: int) -> dict:
    from ..stamp import environment_stamp

    stamp = environment_stamp()
    if stamp.gpu_count < gpus:
        raise RecordError(f"record {name} is a measurement on {_gpus(gpus)}; this machine has "
                          f"{stamp.gpu_count}: make it on a machine with {_gpus(gpus)}")
    for worker in workers:  # imported here only to be hashed: their code made the rows too
        importlib.import_module(worker)
    mine = [m for m in sys.modules if m.split(".")[0] == "tutorial_utils"]
    return {"event": "record", "name": name, "what": what, "gpus": gpus,
            "command": command(program, cfg), "config": to_dict(cfg),
            "stamp": stamp.as_dict(), "modules": module_hashes(mine), "rows": n_rows}


def write(name: str, cfg, rows: Sequence, program: str, workers: Sequence[str] = (),
          root: Path | None = None, *, gpus: int, what: str = "") -> Path:
    """Replace the record ``name`` with ``rows`` measured by ``program`` (a module) with
    ``cfg`` on ``gpus`` GPUs (refused on a machine with fewer); ``workers`` are the modules it
    launched, hashed with everything it imported. Atomic: a write that fails or is
    interrupted leaves the old record whole."""
    rows = [as_row(r) for r in rows]
    header = _header(name, cfg, program, workers, gpus, what, len(rows))
    path = path_of(name, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    rewrite_jsonl(path, [header, *rows])
    return path


def write_part(name: str, cfg, rows: Sequence[dict], order: Sequence[str], program: str,
               workers: Sequence[str] = (), root: Path | None = None, *, gpus: int,
               what: str = "") -> tuple[Path, int]:
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
            and old.commit == environment_stamp().git_commit
            and old.header["modules"] == module_hashes(old.header["modules"])
            and set(old.header["modules"]) <= set(mine))
    kept = [r for r in old.rows if r["run"] not in new] if same else []
    rank = {label: i for i, label in enumerate(order)}
    combined = sorted([*kept, *rows], key=lambda r: rank.get(r["run"], len(rank)))  # stable
    path = write(name, cfg, combined, program, workers, root, gpus=gpus, what=what)
    return path, len({r["run"] for r in kept})


def command(program: str, cfg) -> str:
    """The command line that remakes a record: the program and its non-default options."""
    return shlex.join(["python", "-m", program, *cfg.to_argv()])


@dataclass(frozen=True)
class Compare:
    """How a chapter sets this machine's rows beside its record's: the fields that name a row
    and the one number to compare, with its heading."""

    keys: tuple[str, ...]
    value: str
    heading: str
    fmt: str = ".2f"

    def table(self, record: list, here: list, record_hw: str, here_hw: str) -> str:
        """One line per row of either: its name, the record's value, this machine's."""
        from .report import Column, table

        def keyed(rows: list) -> dict:  # rows without the keys (another kind of row) left out
            return {tuple(str(_get(r, k)) for k in self.keys): _get(r, self.value)
                    for r in rows if all(_get(r, k) is not None for k in self.keys)}

        theirs, mine = keyed(record), keyed(here)
        names = list(dict.fromkeys([*theirs, *mine]))
        width = max([len(" ".join(n)) for n in names] + [len(self.heading)]) + 2
        rows = [{"name": " ".join(n), "record": theirs.get(n), "here": mine.get(n)}
                for n in names]
        cols = [Column("name", self.heading, width=width, left=True),
                Column("record", f"record: {record_hw}", self.fmt, len(record_hw) + 10),
                Column("here", f"this machine: {here_hw}", self.fmt, len(here_hw) + 16)]
        return table(rows, cols)


def _get(row, key: str):
    return row.get(key) if isinstance(row, dict) else getattr(row, key, None)


def needs_gpus(chapter: str, gpus: int = 1) -> Callable[[object], None]:
    """A machine check for a benchmark's ``main`` (``parse_or_exit``): one line, before any
    work, where this machine has fewer GPUs than its measurements need."""
    def check(_cfg) -> None:
        from ..config import ConfigError
        from ..devices import gpu_count

        if gpu_count() < gpus:
            raise ConfigError(f"chapter {chapter}'s measurements need {_gpus(gpus)}, this "
                              f"machine has {gpu_count()}; the chapter reads them from its "
                              "records")
    return check


def measures_here(gpus: int) -> bool:
    """Whether :func:`measured` runs the measurement on this machine (asked, and able to)."""
    from ..devices import gpu_count

    return measuring() and gpu_count() >= gpus


def config_for(name: str, cfg, gpus: int):
    """The configuration whose numbers a chapter will show for ``name``: ``cfg`` where it is
    measured here (or there is no record), else the record's, as ``cfg``'s type."""
    record = None if measures_here(gpus) else load(name)
    return cfg if record is None else from_row(type(cfg), record.header["config"])


def measured(name: str, measure: Callable[[], list] | None, *, gpus: int, cfg=None,
             row_type: type | None = None, compare: Compare | None = None,
             stand_in: Callable[[], list] | None = None,
             stand_in_where: str = "CPU processes") -> tuple[list, Source]:
    """A chapter's GPU measurement ``name`` on ``gpus`` GPUs: its rows and where they come from.

    - ``TUTORIAL_MEASURE=1`` on a machine with ``gpus`` GPUs: ``measure()`` runs here, and the
      text sets its rows beside the record's (``compare``).
    - Otherwise the record's rows; a machine with the GPUs is told how to measure itself.
    - No record yet: ``stand_in()`` if given (a small run in CPU processes, said to be one),
      else no rows and a text that says the measurement is pending and how to make it.
    ``row_type``: the dataclass the rows are read back as. ``measure=None``: a measurement
    too long for a chapter, which only ``make records`` remakes.
    """
    from ..devices import gpu_count

    have, record = gpu_count(), load(name)
    rows = record.typed(row_type) if record is not None and row_type else \
        (record.rows if record is not None else [])
    make = f"`make records` on a machine with {_gpus(gpus)} makes it"
    if measure is not None and measures_here(gpus):
        return _measure_here(name, measure(), record, rows, cfg, compare, make)
    if record is None:
        return _without_record(name, gpus, have, make, stand_in, stand_in_where, cfg)
    run = (record.header["command"], record.commit, record.header["stamp"]["date_utc"])
    text = record.describe(short=run in _DESCRIBED)
    _DESCRIBED.add(run)
    if measuring() and measure is None:
        text += f"\n{MEASURE_ENV}=1: this measurement takes too long to remake in a chapter."
    elif measuring():
        text += (f"\n{MEASURE_ENV}=1, but this machine has {have} GPU(s) and the measurement "
                 f"needs {gpus}: the record's numbers follow.")
    elif gpus and have >= gpus:
        text += (f"\nThis machine has {_gpus(have)}: {MEASURE_ENV}=1 measures them instead of "
                 "reading this record.")
    made = f"a record made on {record.hardware} on {record.date}"
    return rows, Source(text, record.hardware, record.header["config"], made,
                        stamp=record.header["stamp"])


def _measure_here(name, here, record, rows, cfg, compare, make) -> tuple[list, Source]:
    """This machine's rows, and a text that sets them beside the record's where there is one."""
    from ..stamp import environment_stamp

    hardware = environment_stamp().hardware
    lines = [f"Measured here, on {hardware} ({MEASURE_ENV}=1)."]
    if record is not None:
        lines.append(f"Beside it, record {name}: {record.hardware}, {record.date}, "
                     f"commit {record.commit}.")
        if cfg is not None and (differ := _differences(record.header["config"], cfg)):
            lines.append(f"Its settings differ: {differ}.")
        if compare is not None:
            lines += ["", compare.table(rows, here, record.hardware, hardware)]
    else:
        lines.append(f"No record {name} to set beside it yet ({make}).")
    return here, Source("\n".join(lines), hardware, to_dict(cfg) if cfg else {},
                        f"measured here on {hardware}", here=True,
                        stamp=environment_stamp().as_dict())


_DESCRIBED: set[tuple] = set()  # the runs whose records this process described in full


def _without_record(name, gpus, have, make, stand_in, where, cfg) -> tuple[list, Source]:
    from ..stamp import environment_stamp

    own = (f" This machine has {_gpus(have)}: {MEASURE_ENV}=1 measures them." if gpus
           and have >= gpus else "")
    if stand_in is None:
        text = f"Pending: no record {name} yet; {make}.{own}"
        return [], Source(textwrap.fill(text, 96), "", {}, "pending")
    rows, cpu = stand_in(), environment_stamp().cpu_model
    text = (f"No record {name} yet ({make}): measured here instead, in {where} on this "
            f"machine's CPU ({cpu}), at a small size: not a GPU measurement.{own}")
    return rows, Source(textwrap.fill(text, 96), f"{where} ({cpu})",
                        to_dict(cfg) if cfg else {}, f"{where} on this machine's CPU", here=True)


def _differences(theirs: dict, cfg) -> str:
    """The settings of a record that differ from ``cfg``'s, as "name record/here"."""
    mine = to_dict(cfg)
    return ", ".join(f"{k} {theirs.get(k)} there, {v} here" for k, v in mine.items()
                     if k not in ("record", "out") and theirs.get(k) != v)


@dataclass(frozen=True)
class Index:
    """Every record of the book, and the records chapters wait for (they read none yet)."""

    made: list[Record]
    pending: dict[str, list[str]]  # a missing record's name -> the chapters that look for it

    def _repr_markdown_(self) -> str:
        lines = ["| record | what it measures | measured on | code changed since |",
                 "|---|---|---|---|"]
        for r in self.made:
            changed, total = len(r.changed_modules()), len(r.header.get("modules", {}))
            lines.append(f"| `{r.name}` | {r.header.get('what', '')} | {r.machine}, "
                         f"{r.header['stamp']['date_utc']} UTC, commit `{r.commit}` | "
                         + (f"{changed} of {total} modules" if total else "not known")
                         + " |")
        return "\n".join(lines)

    def commands(self) -> str:
        """The command that remakes each record, as a Markdown list."""
        return "\n".join(f"- `{r.name}`: `{r.header['command']}`" for r in self.made)

    def notes(self) -> str:
        """How the records made from a chapter's stored output were made, one line each."""
        return "\n".join(f"- `{r.name}`: {r.header['source']}." for r in self.made
                         if r.header.get("source"))

    def __repr__(self) -> str:
        return f"<{len(self.made)} records, {len(self.pending)} pending>"

    def __str__(self) -> str:
        out = [f"{r.name}: {r.hardware}, {r.date}, commit {r.commit}" for r in self.made]
        out += [f"{name}: pending ({', '.join(chapters)})" for name, chapters
                in self.pending.items()]
        return "\n".join(out)


def index(root: Path | None = None, notebooks: Path | None = None) -> Index:
    """The records under ``root`` (the book's by default), and those that the executed
    chapters under ``notebooks`` looked for and did not find."""
    root = Path(root or ROOT)
    made = [r for p in sorted(root.glob("*.jsonl")) if (r := load(p.stem, root)) is not None]
    pending: dict[str, list[str]] = {}
    for nb in sorted(Path(notebooks or root.parents[1] / "notebooks").glob("*.ipynb")):
        meta = json.loads(nb.read_text()).get("metadata", {}).get("tutorial_utils", {})
        for key, state in meta.get("records", {}).items():
            if state.get("sha256") == "missing" and not (root / Path(key).name).exists():
                pending.setdefault(Path(key).stem, []).append(nb.stem)
    return Index(made, dict(sorted(pending.items())))
