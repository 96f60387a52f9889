"""Execute the book's notebooks in place, stamp them, and check that stored outputs are fresh.

``python tools/nbtools.py execute NB...``
    Runs each notebook top to bottom in a fresh kernel, on whatever machine this is (a CPU
    laptop executes the whole book: GPU numbers come from records), and stores its outputs
    together with ``metadata.tutorial_utils``: the environment stamp, the size profile, a hash
    of the code cells, a hash of every ``tutorial_utils`` module that the kernel or a process
    the notebook started (torchrun's workers) imported, and, for every record under
    ``book/data`` the notebook read, a hash of the file and the modules it ran that had
    changed since it was made (what the chapter printed about it).

``python tools/nbtools.py check NB...``
    Fails (exit 1), naming the notebook and what changed, when its code cells, the package
    modules it used, or the records it read (remade, or their modules changed since) differ
    from when its outputs were made. ``make execute NB=...`` on any machine refreshes it.

Which modules and records a notebook used is logged by every process it starts: the kernel runs
with ``modlog/`` on ``PYTHONPATH``, whose ``sitecustomize`` records each ``tutorial_utils``
module as it is imported, and every process the kernel starts inherits both (torchrun, its
workers, ``python -m tutorial_utils.train``); reading a record logs ``record:<name>``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import nbformat

from tutorial_utils.bench import records as recs
from tutorial_utils.bench.records import PACKAGE as PACKAGE_ROOT
from tutorial_utils.bench.records import module_hashes

METADATA_KEY = "tutorial_utils"
MODULE_LOG_VAR = recs.LOG_ENV  # read by modlog/sitecustomize.py
MODLOG = Path(__file__).resolve().parent / "modlog"
RECORD = "record:"  # a logged name that is a record, not a module

# Run in the kernel after the last cell: which package modules did the notebook use, and on what.
_PROBE = """\
import json as _json, sys as _sys
from tutorial_utils.profiles import current_profile as _profile
from tutorial_utils.stamp import environment_stamp as _stamp
print(_json.dumps({
    "modules": sorted(m for m in _sys.modules if m.split(".")[0] == "tutorial_utils"),
    "profile": _profile(),
    "stamp": _stamp().as_dict(),
}))
"""


@dataclass(frozen=True)
class Finding:
    notebook: Path
    problem: str

    def __str__(self) -> str:
        return f"{self.notebook}: {self.problem}"


def code_hash(nb: nbformat.NotebookNode) -> str:
    h = hashlib.sha256()
    for cell in nb.cells:
        if cell.cell_type == "code":
            h.update(cell.source.encode())
            h.update(b"\0")
    return h.hexdigest()


def logged_names(log: Path) -> set[str]:
    """Names the notebook's processes wrote to ``log``, one JSON list per line."""
    names: set[str] = set()
    for line in log.read_text().splitlines() if log.exists() else []:
        try:
            names.update(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by a process killed while writing
    return names


def logged_modules(log: Path) -> set[str]:
    """The package modules among :func:`logged_names`."""
    return {n for n in logged_names(log) if not n.startswith(RECORD)}


REPO = recs.ROOT.parents[1]


def record_key(path: Path) -> str:
    """How the metadata names a record file: relative to the repository where it lies in it."""
    path = Path(path).resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def record_state(key: str, package_root: Path = PACKAGE_ROOT) -> dict:
    """What a chapter's output shows of the record file ``key``: its hash and the modules it
    ran that have changed since (the line the chapter prints)."""
    path = REPO / key  # an absolute key stays absolute
    if not path.exists():
        return {"sha256": "missing", "changed": []}
    header = json.loads(path.read_text().splitlines()[0])
    then = header.get("modules", {})
    now = module_hashes(then, package_root)
    return {"sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            "changed": sorted(m for m, h in now.items() if then[m] != h)}


def _run_probe_last(nb: nbformat.NotebookNode, cwd: Path, timeout: int) -> dict:
    from nbclient import NotebookClient

    nb.cells.append(nbformat.v4.new_code_cell(_PROBE))
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "modules.jsonl"
        try:
            client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                    resources={"metadata": {"path": str(cwd)}})
            path = os.pathsep.join([str(MODLOG), *filter(None, [os.environ.get("PYTHONPATH")])])
            client.execute(env={**os.environ, MODULE_LOG_VAR: str(log), "PYTHONPATH": path})
            cell = nb.cells[-1]
            text = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
            probe = json.loads(text.strip().splitlines()[-1])
        finally:
            nb.cells.pop()
        names = logged_names(log)
        probe["modules"] = sorted(set(probe["modules"]) | logged_modules(log))
        probe["records"] = sorted({record_key(Path(n.removeprefix(RECORD))) for n in names
                                   if n.startswith(RECORD)})
    return probe


def execute_notebook(path: Path, *, timeout: int = 1800,
                     package_root: Path = PACKAGE_ROOT) -> dict:
    """Execute ``path`` in place and stamp it; return the metadata written."""
    nb = nbformat.read(path, as_version=4)
    probe = _run_probe_last(nb, path.parent, timeout)
    meta = {
        "code_sha256": code_hash(nb),
        "package_modules": module_hashes(probe["modules"], package_root),
        "records": {r: record_state(r, package_root) for r in probe["records"]},
        "profile": probe["profile"],
        "stamp": probe["stamp"],
    }
    nb.metadata[METADATA_KEY] = meta
    nbformat.write(nb, path)
    return meta


def stale_problems(nb: nbformat.NotebookNode, package_root: Path = PACKAGE_ROOT) -> list[str]:
    """Everything that makes the stored outputs of ``nb`` stale (empty when fresh)."""
    meta = nb.metadata.get(METADATA_KEY, {})
    if "code_sha256" not in meta:
        return ["has never been executed by `make execute`"]
    problems = []
    if meta.get("code_sha256") != code_hash(nb):
        problems.append("code cells changed since its outputs were made")
    recorded = meta.get("package_modules", {})
    now = module_hashes(list(recorded), package_root)
    if changed := [m for m, h in now.items() if recorded[m] != h]:
        problems.append(f"package modules it uses changed: {', '.join(changed)}")
    for name, then in meta.get("records", {}).items():
        state = record_state(name, package_root)
        if state["sha256"] != then["sha256"]:
            what = "made" if then["sha256"] == "missing" else (
                "removed" if state["sha256"] == "missing" else "remade")
            problems.append(f"record {name} was {what} since its outputs were made")
        elif state["changed"] != then["changed"]:
            problems.append(f"record {name}: the modules it ran that changed since differ from "
                            f"what the chapter printed ({', '.join(state['changed']) or 'none'})")
    return problems


def check_notebook(path: Path, *, package_root: Path = PACKAGE_ROOT) -> list[Finding]:
    """What makes ``path`` stale (empty when fresh)."""
    nb = nbformat.read(path, as_version=4)
    return [Finding(path, p) for p in stale_problems(nb, package_root)]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python tools/nbtools.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("execute", help="execute notebooks in place and stamp them")
    ex.add_argument("--timeout", type=int, default=1800, help="seconds per cell")
    ck = sub.add_parser("check", help="fail if stored outputs are stale")
    for p in (ex, ck):
        p.add_argument("notebooks", nargs="+", type=Path)
    return parser


def _execute(args: argparse.Namespace) -> int:
    for path in args.notebooks:
        print(f"executing {path} ...", flush=True)
        meta = execute_notebook(path, timeout=args.timeout)
        hw = meta["stamp"]["gpu_count"], sorted(set(meta["stamp"]["gpu_names"]))
        print(f"  done: profile={meta['profile']} gpus={hw[0]} {hw[1]}, "
              f"{len(meta['package_modules'])} modules, records {sorted(meta['records'])}")
    return 0


def _check(args: argparse.Namespace) -> int:
    findings = [f for p in args.notebooks for f in check_notebook(p)]
    for f in findings:
        print(f"stale: {f}", file=sys.stderr)
    if stale := sorted({str(f.notebook) for f in findings}):
        print(f"re-execute them on any machine: make execute NB=\"{' '.join(stale)}\"",
              file=sys.stderr)
        return 1
    print(f"{len(args.notebooks)} notebook(s) fresh")
    return 0


def _main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return {"execute": _execute, "check": _check}[args.command](args)


if __name__ == "__main__":
    sys.exit(_main())
