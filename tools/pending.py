"""The pending notice: a stale chapter whose re-execution needs GPUs says so at its top.

``nbtools pending`` writes it, never a person: a warning admonition as the first cell, tagged
``pending-notice``, saying which content the stored outputs come from, what changed since and
that re-execution on N GPUs is pending, with the same facts in ``metadata.tutorial_utils.pending``.
``nbtools check`` accepts a stale notebook only with the notice this module would write now
from that record and from the current findings; ``nbtools execute`` removes both.
"""

from __future__ import annotations

import datetime as _dt
from pathlib import Path

import nbformat

METADATA_KEY = "tutorial_utils"
TAG = "pending-notice"


def executed(meta: dict) -> bool:
    return "code_sha256" in meta


def _gpus(n: int) -> str:
    return f"{n} GPU" + ("" if n == 1 else "s")


def _made_from(stamp: dict) -> str:
    commit = stamp.get("git_commit", "unknown")
    dirty = " with uncommitted changes" if commit.endswith("+dirty") else ""
    n = stamp.get("gpu_count", 0)
    hardware = f"{n} x {' + '.join(sorted(set(stamp['gpu_names'])))}" if n else "no GPU"
    return (f"The outputs stored in this chapter come from commit `{commit.removesuffix('+dirty')}`"
            f"{dirty}, executed on {hardware} on {stamp.get('date_utc', '?')} UTC.")


def render(path: Path, meta: dict) -> str:
    """The notice's text, from ``meta`` (the notebook's ``metadata.tutorial_utils``) alone."""
    record = meta["pending"]
    gpus = _gpus(record["gpus"])
    lines = [f":::{{admonition}} Re-execution on {gpus} pending", ":class: warning", ""]
    if executed(meta):
        lines += [_made_from(meta.get("stamp", {})), "What they lack, or what has changed since:",
                  ""]
        lines += [f"- {finding}" for finding in record["findings"]]
    else:
        lines.append("This chapter has never been executed on a GPU machine by `make execute`.")
    if record["reason"]:
        lines += ["", record["reason"]]
    nb = f"{path.resolve().parent.name}/{path.name}"
    lines += ["", f"Re-execution on {gpus} is pending: `make execute NB={nb}` on a machine with "
              f"{gpus}. This notice was written by `nbtools pending` on {record['date']}; "
              "`make execute` removes it.", ":::"]
    return "\n".join(lines)


def gpu_shortfall(nb: nbformat.NotebookNode, gpus: int | None) -> list[str]:
    """A run on fewer GPUs than the chapter's measurements need, as a finding (fresh or not)."""
    n = nb.metadata.get(METADATA_KEY, {}).get("stamp", {}).get("gpu_count", 0)
    if gpus is None or not 0 < n < gpus:
        return []
    return [f"its outputs come from a run on {n} GPU(s); its multi-GPU measurements need {gpus}"]


def notice_cells(nb: nbformat.NotebookNode) -> list[int]:
    return [i for i, c in enumerate(nb.cells) if TAG in c.get("metadata", {}).get("tags", [])]


def remove(nb: nbformat.NotebookNode) -> None:
    """Drop the notice cell(s) and the pending record."""
    for i in reversed(notice_cells(nb)):
        del nb.cells[i]
    nb.metadata.get(METADATA_KEY, {}).pop("pending", None)


def mark(nb: nbformat.NotebookNode, path: Path, findings: list[str], gpus: int,
         reason: str = "") -> None:
    """Record ``findings`` as pending re-execution on ``gpus`` GPUs; (re)write the notice."""
    remove(nb)
    meta = nb.metadata.setdefault(METADATA_KEY, {})
    today = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d")
    meta["pending"] = {"findings": findings, "reason": reason.strip(), "gpus": gpus,
                       "date": today}
    cell = nbformat.v4.new_markdown_cell(render(path, meta))
    # Jupyter honours these; the check catches an edit made anyway.
    cell.metadata.update(tags=[TAG], editable=False, deletable=False)
    nb.cells.insert(0, cell)


def present(nb: nbformat.NotebookNode) -> bool:
    return bool(notice_cells(nb)) or "pending" in nb.metadata.get(METADATA_KEY, {})


def problems(nb: nbformat.NotebookNode, path: Path, findings: list[str]) -> list[str]:
    """Why the notebook's notice does not count for ``findings`` (empty when it does)."""
    meta = nb.metadata.get(METADATA_KEY, {})
    cells = notice_cells(nb)
    if "pending" not in meta:
        return ["carries a pending notice that `nbtools pending` did not write"]
    if not cells:
        return ["its pending notice cell was removed (metadata.tutorial_utils.pending remains)"]
    cell = nb.cells[0]
    if cells != [0]:
        return ["its pending notice is not the notebook's one first cell"]
    if cell.cell_type != "markdown" or cell.source != render(path, meta):
        return ["its pending notice differs from what `nbtools pending` wrote (edited by hand?)"]
    if not findings:
        return ["is fresh but still carries a pending notice"]
    if meta["pending"]["findings"] != findings:
        recorded = "; ".join(meta["pending"]["findings"])
        return [f"its pending notice is out of date: it records '{recorded}'"]
    return []
