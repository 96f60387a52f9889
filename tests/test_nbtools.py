"""The stale-output check, both ways, the pending notice, and the executor's refusal to
overwrite GPU outputs."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import nbtools  # tools/, on the path from conftest.py
import pending
import pytest
from nbtools import RefusedError, check_notebook, execute_notebook, mark_pending

import tutorial_utils

PACKAGE = Path(tutorial_utils.__file__).resolve().parent


@pytest.fixture
def package_copy(tmp_path):
    """A copy of the package source to change without touching the real one."""
    dst = tmp_path / "src" / "tutorial_utils"  # importable with PYTHONPATH=tmp_path/src
    shutil.copytree(PACKAGE, dst, ignore=shutil.ignore_patterns("__pycache__"))
    return dst


@pytest.fixture
def notebook(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
    nb.cells = [
        nbformat.v4.new_markdown_cell("# a chapter"),
        nbformat.v4.new_code_cell("from tutorial_utils.toy import toy_output_shape\n"
                                  "print(toy_output_shape())"),
    ]
    path = tmp_path / "chapter.ipynb"
    nbformat.write(nb, path)
    return path


def _edit_code(path, new_source):
    nb = nbformat.read(path, as_version=4)
    nb.cells[1].source = new_source
    nbformat.write(nb, path)


def test_execution_stores_outputs_and_a_stamp(notebook, package_copy):
    meta = execute_notebook(notebook, force=True, package_root=package_copy)
    nb = nbformat.read(notebook, as_version=4)
    assert nb.cells[1].outputs[0]["text"].strip() == "(16, 3, 2, 6)"
    assert len(nb.cells) == 2, "the probe cell must not be left in the notebook"
    assert "tutorial_utils.toy" in meta["package_modules"]
    assert "tutorial_utils.models.wrn" not in meta["package_modules"]
    assert meta["stamp"]["torch"] and meta["profile"] in ("smoke", "full")


def test_stale_check_both_ways(notebook, package_copy):
    assert [str(f) for f in check_notebook(notebook, allow_cpu=True)] == [
        f"{notebook}: has never been executed by `make execute`"
    ]
    execute_notebook(notebook, force=True, package_root=package_copy)
    assert check_notebook(notebook, allow_cpu=True, package_root=package_copy) == []

    _edit_code(notebook, "print('changed')")
    findings = check_notebook(notebook, allow_cpu=True, package_root=package_copy)
    assert [f.problem for f in findings] == ["code cells changed since its outputs were made"]

    execute_notebook(notebook, force=True, package_root=package_copy)
    assert check_notebook(notebook, allow_cpu=True, package_root=package_copy) == []


def test_a_used_package_module_change_makes_it_stale_an_unused_one_does_not(
    notebook, package_copy
):
    execute_notebook(notebook, force=True, package_root=package_copy)
    with open(package_copy / "models" / "wrn.py", "a") as f:
        f.write("\n# an unrelated change\n")
    assert check_notebook(notebook, allow_cpu=True, package_root=package_copy) == []
    with open(package_copy / "toy.py", "a") as f:
        f.write("\n# a change the notebook depends on\n")
    (finding,) = check_notebook(notebook, allow_cpu=True, package_root=package_copy)
    assert finding.problem == "package modules it uses changed: tutorial_utils.toy"


def test_cpu_outputs_are_flagged_unless_allowed(notebook, package_copy):
    meta = execute_notebook(notebook, force=True, package_root=package_copy)
    findings = check_notebook(notebook, package_root=package_copy)
    if meta["stamp"]["gpu_count"] == 0:
        assert [f.problem for f in findings] == ["its outputs come from a run without a GPU"]
    else:
        assert findings == []


def test_cpu_run_refuses_to_replace_gpu_outputs(notebook, monkeypatch):
    nb = nbformat.read(notebook, as_version=4)
    nb.metadata[nbtools.METADATA_KEY] = {"stamp": {"gpu_count": 2, "gpu_names": ["NVIDIA H200"]}}
    nbformat.write(nb, notebook)
    before = notebook.read_bytes()
    monkeypatch.setattr("tutorial_utils.devices.gpu_count", lambda: 0)
    with pytest.raises(RefusedError, match="outputs from a GPU run \\(NVIDIA H200\\)"):
        execute_notebook(notebook)
    assert notebook.read_bytes() == before, "a refused run must leave the notebook untouched"


def test_cli_exit_codes(notebook, package_copy, capsys):
    assert nbtools._main(["check", str(notebook)]) == 1
    err = capsys.readouterr().err
    assert "never been executed" in err and f'make execute NB="{notebook}"' in err


# A notebook that starts a process running a module of the package copy, the way a chapter
# runs `torchrun -m tutorial_utils.train`: the kernel itself never imports it.
_LAUNCHING_CELL = """\
import os, subprocess, sys
env = {**os.environ, "PYTHONPATH": os.pathsep.join([%r, os.environ["PYTHONPATH"]])}
print(subprocess.run([sys.executable, "-m", "tutorial_utils.worker_demo"], env=env,
                     check=True, capture_output=True, text=True).stdout)
"""


def test_modules_of_launched_processes_are_checked_too(tmp_path, package_copy):
    (package_copy / "worker_lib.py").write_text("ANSWER = 42\n")
    (package_copy / "worker_demo.py").write_text(
        "from tutorial_utils.worker_lib import ANSWER\nprint('worker says', ANSWER)\n")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(_LAUNCHING_CELL % str(package_copy.parent))]
    path = tmp_path / "launching.ipynb"
    nbformat.write(nb, path)

    meta = execute_notebook(path, force=True, package_root=package_copy)
    assert "worker says 42" in nbformat.read(path, as_version=4).cells[0].outputs[0]["text"]
    assert {"tutorial_utils.worker_demo", "tutorial_utils.worker_lib"} <= set(
        meta["package_modules"]), "the -m main module and what it imports are both recorded"
    assert check_notebook(path, allow_cpu=True, package_root=package_copy) == []

    worker = package_copy / "worker_lib.py"
    worker.write_text("ANSWER = 42  # a change to the code behind the worker's output\n")
    (finding,) = check_notebook(path, allow_cpu=True, package_root=package_copy)
    assert finding.problem == "package modules it uses changed: tutorial_utils.worker_lib"

    worker.write_text("ANSWER = 42\n")  # changed back: what made the outputs is there again
    assert check_notebook(path, allow_cpu=True, package_root=package_copy) == []
    nb = nbformat.read(path, as_version=4)
    nb.cells[0].source += "# edited\n"
    nbformat.write(nb, path)
    (finding,) = check_notebook(path, allow_cpu=True, package_root=package_copy)
    assert finding.problem == "code cells changed since its outputs were made"


def _with_logger(log=None):
    env = {k: v for k, v in os.environ.items() if k != nbtools.MODULE_LOG_VAR}
    env["PYTHONPATH"] = os.pathsep.join([str(nbtools.MODLOG), env.get("PYTHONPATH", "")])
    return env | ({nbtools.MODULE_LOG_VAR: str(log)} if log else {})


def test_the_module_log_is_written_only_when_asked(tmp_path):
    log = tmp_path / "modules.jsonl"
    run = [sys.executable, "-c", "import tutorial_utils.toy"]
    subprocess.run(run, check=True, env=_with_logger())
    assert not log.exists()
    for _ in range(2):  # appended, as by several workers
        subprocess.run(run, check=True, env=_with_logger(log))
    with open(log, "a") as f:
        f.write('["tutorial_utils.cut_sh')  # a writer killed mid-line
    lines = log.read_text().splitlines()
    assert len(lines) == 5 and set(lines[:2]) == {'["tutorial_utils"]', '["tutorial_utils.toy"]'}
    assert nbtools.logged_modules(log) == {"tutorial_utils", "tutorial_utils.toy"}


def test_a_process_killed_by_a_signal_has_logged_what_it_ran(tmp_path):
    # the program named after -m (runpy runs it without an import event), and its imports
    log = tmp_path / "modules.jsonl"
    crash = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    subprocess.run([sys.executable, "-c", "import tutorial_utils.profiles; " + crash],
                   env=_with_logger(log))
    assert nbtools.logged_modules(log) == {"tutorial_utils", "tutorial_utils.profiles"}
    log.unlink()
    done = subprocess.run([sys.executable, "-m", "tutorial_utils.workers.hang_demo", "--help"],
                          env=_with_logger(log), capture_output=True)
    assert done.returncode == 0
    assert "tutorial_utils.workers.hang_demo" in nbtools.logged_modules(log)


# --- the pending notice -----------------------------------------------------------------

def _as_if_executed(path, package_root=PACKAGE, modules=("tutorial_utils", "tutorial_utils.toy")):
    """Stamp ``path`` as a 2-GPU run would, without running it."""
    nb = nbformat.read(path, as_version=4)
    nb.metadata[nbtools.METADATA_KEY] = {
        "code_sha256": nbtools.code_hash(nb),
        "package_modules": nbtools.module_hashes(list(modules), package_root),
        "profile": "full",
        "stamp": {"gpu_count": 2, "gpu_names": ["NVIDIA H200"] * 2,
                  "git_commit": "0123456789ab+dirty", "date_utc": "2026-11-30 13:31"},
    }
    nbformat.write(nb, path)


def _notice(path):
    nb = nbformat.read(path, as_version=4)
    return nb.cells[0] if pending.notice_cells(nb) == [0] else None


def test_the_notice_says_where_the_outputs_come_from_and_what_changed(notebook, package_copy):
    _as_if_executed(notebook, package_copy)
    code_before = nbtools.code_hash(nbformat.read(notebook, as_version=4))
    with open(package_copy / "toy.py", "a") as f:
        f.write("\n# moved here from elsewhere\n")
    problems = mark_pending(notebook, gpus=2, reason="Code only moved: toy.py gained a comment.",
                            package_root=package_copy)
    assert problems == ["package modules it uses changed: tutorial_utils.toy"]

    cell = _notice(notebook)
    assert cell.cell_type == "markdown" and cell.source.startswith(":::{admonition}")
    for words in ["commit `0123456789ab` with uncommitted changes", "2 x NVIDIA H200",
                  "2026-11-30 13:31 UTC", "- package modules it uses changed: tutorial_utils.toy",
                  "Code only moved: toy.py gained a comment.", "Re-execution on 2 GPUs is pending",
                  f"`make execute NB={notebook.parent.name}/chapter.ipynb`"]:
        assert words in cell.source
    nb = nbformat.read(notebook, as_version=4)
    assert nb.metadata[nbtools.METADATA_KEY]["pending"]["findings"] == problems
    assert nbtools.code_hash(nb) == code_before, "the notice is not code"

    (finding,) = check_notebook(notebook, package_root=package_copy)
    assert finding.pending and finding.problem == problems[0]


def test_check_passes_a_marked_notebook_and_fails_an_unmarked_one(notebook, capsys):
    _as_if_executed(notebook)
    _edit_code(notebook, "print('changed')")
    assert nbtools._main(["check", str(notebook)]) == 1
    assert "stale: " in capsys.readouterr().err
    assert nbtools._main(["pending", str(notebook), "--gpus", "2",
                          "--reason", "Code only moved."]) == 0
    capsys.readouterr()
    assert nbtools._main(["check", str(notebook)]) == 0
    out = capsys.readouterr().out
    assert f"pending: {notebook}: code cells changed since its outputs were made" in out
    assert "0 notebook(s) fresh, 1 pending re-execution" in out


def _edit_notice(nb):
    nb.cells[0].source = nb.cells[0].source.replace("2 GPUs", "1 GPU")


def _typed_notice(nb):
    del nb.metadata[nbtools.METADATA_KEY]["pending"]


def _moved_notice(nb):
    nb.cells.insert(1, nb.cells.pop(0))


@pytest.mark.parametrize("tamper, problem", [
    (_edit_notice, "its pending notice differs from what `nbtools pending` wrote"),
    (lambda nb: nb.cells.pop(0), "its pending notice cell was removed"),
    (_typed_notice, "carries a pending notice that `nbtools pending` did not write"),
    (_moved_notice, "its pending notice is not the notebook's one first cell"),
])
def test_a_hand_made_or_tampered_notice_does_not_count(notebook, tamper, problem):
    _as_if_executed(notebook)
    _edit_code(notebook, "print('changed')")
    mark_pending(notebook, gpus=2)
    nb = nbformat.read(notebook, as_version=4)
    tamper(nb)
    nbformat.write(nb, notebook)
    findings = check_notebook(notebook)
    assert not any(f.pending for f in findings)
    assert any(f.problem.startswith(problem) for f in findings), findings


def test_a_notice_covers_only_the_findings_it_records(notebook, package_copy):
    _as_if_executed(notebook, package_copy)
    _edit_code(notebook, "print('changed')")
    mark_pending(notebook, gpus=2, package_root=package_copy)
    with open(package_copy / "toy.py", "a") as f:
        f.write("\n# a later change\n")
    problems = [f.problem for f in check_notebook(notebook, package_root=package_copy)]
    assert "its pending notice is out of date: it records 'code cells changed since its " \
           "outputs were made'" in problems
    assert mark_pending(notebook, gpus=2, package_root=package_copy) == [
        "code cells changed since its outputs were made",
        "package modules it uses changed: tutorial_utils.toy",
    ]
    assert all(f.pending for f in check_notebook(notebook, package_root=package_copy))


def test_a_notice_on_a_fresh_notebook_fails_and_pending_removes_it(notebook):
    _as_if_executed(notebook)
    original = nbformat.read(notebook, as_version=4).cells[1].source
    _edit_code(notebook, "print('changed')")
    mark_pending(notebook, gpus=2)
    nb = nbformat.read(notebook, as_version=4)
    nb.cells[2].source = original  # the code change is undone
    nbformat.write(nb, notebook)
    (finding,) = check_notebook(notebook)
    assert finding.problem == "is fresh but still carries a pending notice"
    assert mark_pending(notebook, gpus=2) == []
    assert _notice(notebook) is None and check_notebook(notebook) == []


def test_a_never_executed_notebook_may_be_marked_and_execute_removes_the_notice(
    notebook, package_copy
):
    assert mark_pending(notebook, gpus=2, package_root=package_copy) == [
        "has never been executed by `make execute`"]
    assert "has never been executed on a GPU machine" in _notice(notebook).source
    (finding,) = check_notebook(notebook, package_root=package_copy)
    assert finding.pending

    execute_notebook(notebook, force=True, package_root=package_copy)
    nb = nbformat.read(notebook, as_version=4)
    assert _notice(notebook) is None and len(nb.cells) == 2
    assert "pending" not in nb.metadata[nbtools.METADATA_KEY]
    assert check_notebook(notebook, allow_cpu=True, package_root=package_copy) == []


def test_the_notice_survives_nbval(notebook, tmp_path):
    _as_if_executed(notebook)
    _edit_code(notebook, "print('changed')")
    mark_pending(notebook, gpus=2, reason="Code only moved.")
    before = notebook.read_bytes()
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax",
         "--rootdir", str(tmp_path), str(notebook)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout + run.stderr
    assert notebook.read_bytes() == before
    assert all(f.pending for f in check_notebook(notebook))


def test_a_run_on_fewer_gpus_than_the_chapter_needs_may_carry_the_notice(notebook):
    _as_if_executed(notebook)  # a stamp of 2 GPUs
    nb = nbformat.read(notebook, as_version=4)
    nb.metadata[nbtools.METADATA_KEY]["stamp"].update(gpu_count=1, gpu_names=["NVIDIA H200"])
    nbformat.write(nb, notebook)
    assert check_notebook(notebook) == []  # fresh: a one-GPU run is a valid run
    assert mark_pending(notebook, gpus=2) == [
        "its outputs come from a run on 1 GPU(s); its multi-GPU measurements need 2"]
    (finding,) = check_notebook(notebook)
    assert finding.pending and "need 2" in finding.problem
    assert "Re-execution on 2 GPUs pending" in _notice(notebook).source
    assert mark_pending(notebook, gpus=1) == [] and _notice(notebook) is None
