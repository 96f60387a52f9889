"""Execute the book's notebooks in place, stamp them, and check that stored outputs are fresh.

``python tools/nbtools.py execute NB...``
    Runs each notebook top to bottom in a fresh kernel and stores its outputs together with
    ``metadata.tutorial_utils``: the environment stamp, the size profile, a hash of the code
    cells and a hash of every ``tutorial_utils`` module that the kernel or a process the
    notebook started (torchrun's workers) imported; drops a pending notice. Refuses to replace
    outputs made on a GPU with a run on a machine without one, unless ``--force``.

``python tools/nbtools.py check NB...``
    Fails (exit 1), naming the notebook and what changed, when its code cells or the package
    modules it used changed since its outputs were made, or those were not made on a GPU;
    passes (printing ``pending:``) one with the pending notice written for those findings.

``python tools/nbtools.py pending NB... --gpus N [--reason TEXT]``
    Writes that notice at the top of each stale notebook, or of one whose outputs come from
    fewer GPUs than N (``pending.py``).

Which modules a notebook used is logged by every process it starts: the kernel runs with
``modlog/`` on ``PYTHONPATH``, whose ``sitecustomize`` records each ``tutorial_utils`` module
as it is imported, and every process the kernel starts inherits both (torchrun, its workers,
``python -m tutorial_utils.train``).
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
import pending

from tutorial_utils.bench.records import PACKAGE as PACKAGE_ROOT
from tutorial_utils.bench.records import module_hashes

METADATA_KEY = pending.METADATA_KEY
MODULE_LOG_VAR = "TUTORIAL_MODULE_LOG"  # read by modlog/sitecustomize.py
MODLOG = Path(__file__).resolve().parent / "modlog"

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


class RefusedError(RuntimeError):
    """The executor will not overwrite GPU outputs with a CPU run."""


@dataclass(frozen=True)
class Finding:
    notebook: Path
    problem: str
    pending: bool = False  # acknowledged by the notebook's pending notice

    def __str__(self) -> str:
        return f"{self.notebook}: {self.problem}"


def code_hash(nb: nbformat.NotebookNode) -> str:
    h = hashlib.sha256()
    for cell in nb.cells:
        if cell.cell_type == "code":
            h.update(cell.source.encode())
            h.update(b"\0")
    return h.hexdigest()


def logged_modules(log: Path) -> set[str]:
    """Module names the notebook's processes wrote to ``log``, one JSON list per line."""
    names: set[str] = set()
    for line in log.read_text().splitlines() if log.exists() else []:
        try:
            names.update(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by a process killed while writing
    return names


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
        probe["modules"] = sorted(set(probe["modules"]) | logged_modules(log))
    return probe


def execute_notebook(
    path: Path, *, force: bool = False, timeout: int = 1800, package_root: Path = PACKAGE_ROOT
) -> dict:
    """Execute ``path`` in place and stamp it; return the metadata written."""
    from tutorial_utils.devices import gpu_count

    nb = nbformat.read(path, as_version=4)
    previous = nb.metadata.get(METADATA_KEY, {})
    if previous.get("stamp", {}).get("gpu_count", 0) > 0 and gpu_count() == 0 and not force:
        raise RefusedError(
            f"{path} holds outputs from a GPU run ({previous['stamp']['gpu_names'][0]}); "
            "this machine has no GPU. Run on a GPU machine, or pass --force (make execute FORCE=1)"
        )
    pending.remove(nb)  # it describes the outputs this run replaces
    probe = _run_probe_last(nb, path.parent, timeout)
    meta = {
        "code_sha256": code_hash(nb),
        "package_modules": module_hashes(probe["modules"], package_root),
        "profile": probe["profile"],
        "stamp": probe["stamp"],
    }
    nb.metadata[METADATA_KEY] = meta
    nbformat.write(nb, path)
    return meta


def stale_problems(nb: nbformat.NotebookNode, allow_cpu: bool, package_root: Path) -> list[str]:
    """Everything that makes the stored outputs of ``nb`` stale (empty when fresh)."""
    meta = nb.metadata.get(METADATA_KEY, {})
    if not pending.executed(meta):
        return ["has never been executed by `make execute`"]
    problems = []
    if meta.get("code_sha256") != code_hash(nb):
        problems.append("code cells changed since its outputs were made")
    recorded = meta.get("package_modules", {})
    now = module_hashes(list(recorded), package_root)
    if changed := [m for m, h in now.items() if recorded[m] != h]:
        problems.append(f"package modules it uses changed: {', '.join(changed)}")
    if not allow_cpu and meta.get("stamp", {}).get("gpu_count", 0) == 0:
        problems.append("its outputs come from a run without a GPU")
    return problems


def check_notebook(
    path: Path, *, allow_cpu: bool = False, package_root: Path = PACKAGE_ROOT
) -> list[Finding]:
    """What makes ``path`` stale (empty when fresh); ``pending`` where its notice owns up."""
    nb = nbformat.read(path, as_version=4)
    problems = stale_problems(nb, allow_cpu, package_root)
    if not pending.present(nb):
        return [Finding(path, p) for p in problems]
    # The notice records the strict findings (a CPU run counts), whatever --allow-cpu says.
    short = pending.gpu_shortfall(nb, nb.metadata[METADATA_KEY].get("pending", {}).get("gpus"))
    notice = pending.problems(nb, path, stale_problems(nb, False, package_root) + short)
    return [Finding(path, p, pending=not notice) for p in problems + short + notice]


def mark_pending(
    path: Path, *, gpus: int, reason: str = "", package_root: Path = PACKAGE_ROOT
) -> list[str]:
    """Write (or refresh) the pending notice of ``path``; remove it if ``path`` is fresh."""
    nb = nbformat.read(path, as_version=4)
    if problems := stale_problems(nb, False, package_root) + pending.gpu_shortfall(nb, gpus):
        pending.mark(nb, path, problems, gpus, reason)
    else:
        pending.remove(nb)
    nbformat.write(nb, path)
    return problems


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python tools/nbtools.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("execute", help="execute notebooks in place and stamp them")
    ex.add_argument("--force", action="store_true", help="allow a CPU run to replace GPU outputs")
    ex.add_argument("--timeout", type=int, default=1800, help="seconds per cell")
    ck = sub.add_parser("check", help="fail if stored outputs are stale and not marked pending")
    ck.add_argument("--allow-cpu", action="store_true", help="accept outputs from a CPU run")
    pd = sub.add_parser("pending", help="mark stale notebooks as awaiting re-execution on GPUs")
    pd.add_argument("--gpus", type=int, required=True, help="GPUs the re-execution needs")
    pd.add_argument("--reason", default="", help='shown in the notice, e.g. "code only moved"')
    for p in (ex, ck, pd):
        p.add_argument("notebooks", nargs="+", type=Path)
    return parser


def _execute(args: argparse.Namespace) -> int:
    for path in args.notebooks:
        print(f"executing {path} ...", flush=True)
        try:
            meta = execute_notebook(path, force=args.force, timeout=args.timeout)
        except RefusedError as err:
            print(f"refused: {err}", file=sys.stderr)
            return 2
        hw = meta["stamp"]["gpu_count"], meta["stamp"]["gpu_names"]
        print(f"  done: profile={meta['profile']} gpus={hw[0]} {sorted(set(hw[1]))}")
    return 0


def _check(args: argparse.Namespace) -> int:
    findings = [f for p in args.notebooks for f in check_notebook(p, allow_cpu=args.allow_cpu)]
    for f in findings:
        print(f"{'pending' if f.pending else 'stale'}: {f}", file=sys.stdout if f.pending
              else sys.stderr)
    if stale := sorted({str(f.notebook) for f in findings if not f.pending}):
        print(f"re-execute on a GPU machine: make execute NB=\"{' '.join(stale)}\"\n"
              "or, until that can run, mark them: python tools/nbtools.py pending "
              "NB... --gpus N --reason TEXT", file=sys.stderr)
        return 1
    held = len({f.notebook for f in findings})
    print(f"{len(args.notebooks) - held} notebook(s) fresh"
          + (f", {held} pending re-execution" if held else ""))
    return 0


def _pending(args: argparse.Namespace) -> int:
    for path in args.notebooks:
        problems = mark_pending(path, gpus=args.gpus, reason=args.reason)
        print(f"{path}: pending on {args.gpus} GPU(s): {'; '.join(problems)}" if problems
              else f"{path}: fresh, no notice needed (an old one is removed)")
    return 0


def _main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return {"execute": _execute, "check": _check, "pending": _pending}[args.command](args)


if __name__ == "__main__":
    sys.exit(_main())
