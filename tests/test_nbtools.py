"""The stale-output check, both ways: code cells, the package modules a chapter and the processes
it started imported, and the records it read; any machine may execute a chapter."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import nbtools  # tools/, on the path from conftest.py
import pytest
from nbtools import check_notebook, execute_notebook

import tutorial_utils
from tutorial_utils.bench import records

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
    meta = execute_notebook(notebook, package_root=package_copy)
    nb = nbformat.read(notebook, as_version=4)
    assert nb.cells[1].outputs[0]["text"].strip() == "(16, 3, 2, 6)"
    assert len(nb.cells) == 2, "the probe cell must not be left in the notebook"
    assert "tutorial_utils.toy" in meta["package_modules"]
    assert "tutorial_utils.models.wrn" not in meta["package_modules"]
    assert meta["stamp"]["torch"] and meta["profile"] in ("smoke", "full")


def test_stale_check_both_ways(notebook, package_copy):
    assert [str(f) for f in check_notebook(notebook)] == [
        f"{notebook}: has never been executed by `make execute`"
    ]
    execute_notebook(notebook, package_root=package_copy)
    assert check_notebook(notebook, package_root=package_copy) == []

    _edit_code(notebook, "print('changed')")
    findings = check_notebook(notebook, package_root=package_copy)
    assert [f.problem for f in findings] == ["code cells changed since its outputs were made"]

    execute_notebook(notebook, package_root=package_copy)
    assert check_notebook(notebook, package_root=package_copy) == []


def test_a_used_package_module_change_makes_it_stale_an_unused_one_does_not(
    notebook, package_copy
):
    execute_notebook(notebook, package_root=package_copy)
    with open(package_copy / "models" / "wrn.py", "a") as f:
        f.write("\n# an unrelated change\n")
    assert check_notebook(notebook, package_root=package_copy) == []
    with open(package_copy / "toy.py", "a") as f:
        f.write("\n# a change the notebook depends on\n")
    (finding,) = check_notebook(notebook, package_root=package_copy)
    assert finding.problem == "package modules it uses changed: tutorial_utils.toy"


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

    meta = execute_notebook(path, package_root=package_copy)
    assert "worker says 42" in nbformat.read(path, as_version=4).cells[0].outputs[0]["text"]
    assert {"tutorial_utils.worker_demo", "tutorial_utils.worker_lib"} <= set(
        meta["package_modules"]), "the -m main module and what it imports are both recorded"
    assert check_notebook(path, package_root=package_copy) == []

    worker = package_copy / "worker_lib.py"
    worker.write_text("ANSWER = 42  # a change to the code behind the worker's output\n")
    (finding,) = check_notebook(path, package_root=package_copy)
    assert finding.problem == "package modules it uses changed: tutorial_utils.worker_lib"

    worker.write_text("ANSWER = 42\n")  # changed back: what made the outputs is there again
    assert check_notebook(path, package_root=package_copy) == []
    nb = nbformat.read(path, as_version=4)
    nb.cells[0].source += "# edited\n"
    nbformat.write(nb, path)
    (finding,) = check_notebook(path, package_root=package_copy)
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


# --- records: a chapter that read one is stale once it is remade or its modules change --------

_READING_CELL = """\
from tutorial_utils.bench import records
print(records.load("tiny", root=%r).rows)
"""


def _tiny_record(root, rows, workers=("tutorial_utils.toy",)):
    from dataclasses import dataclass

    from tutorial_utils.config import Config, opt

    @dataclass
    class Tiny(Config):
        size: int = opt(1, "how big")

    return records.write("tiny", Tiny(), rows, "tutorial_utils.bench.tiny", list(workers),
                         root=root, gpus=0)


def test_a_chapter_is_stale_when_a_record_it_read_is_remade(tmp_path):
    root = tmp_path / "data"
    _tiny_record(root, [{"x": 1}])
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(_READING_CELL % str(root))]
    path = tmp_path / "reading.ipynb"
    nbformat.write(nb, path)
    meta = execute_notebook(path)
    key = str((root / "tiny.jsonl").resolve())
    assert meta["records"] == {key: nbtools.record_state(key)}
    assert check_notebook(path) == []

    _tiny_record(root, [{"x": 2}])  # remade: the chapter shows the old numbers
    (finding,) = check_notebook(path)
    assert finding.problem == f"record {key} was remade since its outputs were made"


def test_a_records_changed_modules_are_what_the_chapter_printed(tmp_path, package_copy):
    root = tmp_path / "data"
    _tiny_record(root, [{"x": 1}])
    key = str((root / "tiny.jsonl").resolve())
    state = nbtools.record_state(key, package_copy)
    assert state["changed"] == []
    with open(package_copy / "toy.py", "a") as f:
        f.write("\n# a change to the code the record ran\n")
    assert nbtools.record_state(key, package_copy)["changed"] == ["tutorial_utils.toy"]
    nb = nbformat.v4.new_notebook()
    nb.metadata[nbtools.METADATA_KEY] = {"code_sha256": nbtools.code_hash(nb),
                                         "package_modules": {}, "records": {key: state}}
    assert nbtools.stale_problems(nb, package_copy) == [
        f"record {key}: the modules it ran that changed since differ from what the chapter "
        "printed (tutorial_utils.toy)"]


def test_a_chapter_that_found_no_record_is_stale_once_the_record_is_made(tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(_READING_CELL.replace(".rows", "") % str(root))]
    path = tmp_path / "reading.ipynb"
    nbformat.write(nb, path)
    meta = execute_notebook(path)  # prints None: no record yet, the chapter measured instead
    key = str((root / "tiny.jsonl").resolve())
    assert meta["records"] == {key: {"sha256": "missing", "changed": []}}
    assert check_notebook(path) == []
    _tiny_record(root, [{"x": 1}])
    (finding,) = check_notebook(path)
    assert finding.problem == f"record {key} was made since its outputs were made"


def test_no_chapter_carries_a_notice_of_pending_re_execution():
    # Every chapter re-executes on any machine: none waits for a GPU, none says it does.
    book = Path(__file__).resolve().parents[1]
    for path in [*sorted((book / "notebooks").glob("*.ipynb")), book / "book" / "records.ipynb"]:
        nb = nbformat.read(path, as_version=4)
        assert not [c for c in nb.cells if "pending-notice" in c.metadata.get("tags", [])
                    or "Re-execution on" in c.source], path.name
