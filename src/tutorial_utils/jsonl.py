"""JSON lines: how every job of the package reports its results, one JSON object per line.

The training entry point writes one line per epoch to ``metrics.jsonl``, each worker started
by torchrun writes its measurements the same way, and :func:`~tutorial_utils.launch.torchrun`
reads them back for the cell that launched the job. One line is one complete record, appended
in one write, so a reader never sees half of one unless its writer was killed in the middle of
that write: :func:`read_jsonl` then drops the torn last line instead of failing.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path


def write_jsonl(path: Path, records: Iterable[Mapping]) -> None:
    """Append ``records`` to ``path``, one JSON object per line (the folder is created), and
    make them durable: a run's records must outlive a crash as its checkpoint does."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in records)
    new = not path.exists()
    with open(path, "a") as f:
        f.write(text)  # one write: the lines land whole, after any a reader already has
        f.flush()
        os.fsync(f.fileno())
    if new:  # a new file is an entry in its folder, which a crash could lose
        fsync_path(path.parent)


def rewrite_jsonl(path: Path, records: Iterable[Mapping]) -> None:
    """Replace ``path`` by ``records`` atomically: a reader, or a writer killed half-way, sees
    the old file or the new one, never a mix (written to a temporary file, then renamed)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide the records from other readers
        with os.fdopen(fd, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename makes it the file
        os.replace(tmp, path)
        fsync_path(path.parent)  # the rename is an entry in the folder: a crash could undo it
    finally:
        Path(tmp).unlink(missing_ok=True)


def fsync_path(folder: Path) -> None:
    """Flush a file or a folder (its entries: a rename, a new file) to the disk."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_jsonl(path: Path) -> list[dict]:
    """The records in ``path`` (none if it does not exist); a torn last line is dropped."""
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines) - 1:  # damage in the middle is not a killed writer: say so
                raise ValueError(f"{path}, line {i + 1}: not JSON ({line[:60]!r})") from None
    return records
