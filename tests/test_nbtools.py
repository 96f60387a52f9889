"""The stale-output check, both ways, and the executor's refusal to overwrite GPU outputs."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

import tutorial_utils
from tutorial_utils import launch, nbtools
from tutorial_utils.nbtools import RefusedError, check_notebook, execute_notebook

PACKAGE = Path(nbtools.__file__).resolve().parent


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
env = {**os.environ, "PYTHONPATH": %r}
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


def test_the_module_log_is_written_only_when_asked(tmp_path):
    log = tmp_path / "modules.jsonl"
    run = [sys.executable, "-c", "import tutorial_utils"]
    subprocess.run(run, check=True, env={k: v for k, v in os.environ.items()
                                         if k != nbtools.MODULE_LOG_VAR})
    assert not log.exists()
    for _ in range(2):  # appended, as by several workers
        subprocess.run(run, check=True, env={**os.environ, nbtools.MODULE_LOG_VAR: str(log)})
    with open(log, "a") as f:
        f.write('["tutorial_utils.cut_sh')  # a writer killed mid-line
    assert log.read_text().splitlines()[:2] == ['["tutorial_utils"]'] * 2
    assert nbtools.logged_modules(log) == {"tutorial_utils"}


def test_torchrun_logs_its_target_before_the_workers_start(tmp_path, monkeypatch):
    log = tmp_path / "modules.jsonl"
    monkeypatch.setattr(tutorial_utils, "_MODULE_LOG", str(log))

    def no_launch(*args, **kwargs):
        raise OSError("not launched in this test")

    monkeypatch.setattr(launch.subprocess, "Popen", no_launch)
    with pytest.raises(OSError):
        launch.torchrun("tutorial_utils.parallel.hang_demo")
    assert nbtools.logged_modules(log) == {"tutorial_utils.parallel.hang_demo"}
