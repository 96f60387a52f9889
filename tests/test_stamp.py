import pytest
import torch

from tutorial_utils import stamp as stamp_mod
from tutorial_utils.stamp import environment_stamp


def test_stamp_describes_this_process():
    s = environment_stamp()
    assert s.torch == torch.__version__
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert s.gpu_count == n == len(s.gpu_names) == len(s.gpu_memory_gib)
    assert s.date_utc[:2] == "20" and s.git_commit
    assert s.as_dict()["torch"] == torch.__version__


def test_markdown_and_text_show_the_hardware():
    s = environment_stamp()
    assert s.hardware in s._repr_markdown_() and s.hardware in repr(s)
    if s.gpu_count == 0:
        assert s.hardware.startswith("CPU only") and not s.is_gpu


def test_git_commit_falls_back_to_environment(monkeypatch):
    monkeypatch.setattr(stamp_mod, "_run", lambda *a, **k: "0123456789ab")
    monkeypatch.setenv("TUTORIAL_GIT_COMMIT", "abc123")
    assert stamp_mod._git_commit() == "abc123"  # the environment wins over the checkout


@pytest.mark.parametrize("status, expected", [(" M src/x.py", "0123456789ab+dirty"),
                                              ("", "0123456789ab"),
                                              (" M notebooks/01_cpu.ipynb", "0123456789ab"),
                                              (" M notebooks/a.ipynb\n M Makefile",
                                               "0123456789ab+dirty")])
def test_git_commit_says_when_the_checkout_has_changes(monkeypatch, status, expected):
    monkeypatch.delenv("TUTORIAL_GIT_COMMIT", raising=False)
    said = {"rev-parse": "0123456789ab", "status": status}
    monkeypatch.setattr(stamp_mod, "_run", lambda cmd, cwd=None: said[cmd[1]])
    assert stamp_mod._git_commit() == expected


def test_git_commit_without_git_is_unknown(monkeypatch):
    monkeypatch.delenv("TUTORIAL_GIT_COMMIT", raising=False)
    monkeypatch.setattr(stamp_mod, "_run", lambda *a, **k: None)
    assert stamp_mod._git_commit() == "unknown"


@pytest.mark.gpu
def test_gpu_stamp_names_the_gpu_and_driver():
    s = environment_stamp()
    assert s.is_gpu and s.gpu_names[0] and s.driver != "-"
    assert s.hardware.startswith(f"{s.gpu_count} x ")


def test_cpu_model_comes_from_the_model_name_line(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\n"
                    "model name\t: AMD EPYC 9454   48-Core Processor\nflags\t\t: fpu\n")
    assert stamp_mod.cpu_model(info) == "AMD EPYC 9454 48-Core Processor"


def test_cpu_model_falls_back_without_cpuinfo(tmp_path, monkeypatch):
    monkeypatch.setattr(stamp_mod.platform, "processor", lambda: "")
    monkeypatch.setattr(stamp_mod.platform, "machine", lambda: "aarch64")
    assert stamp_mod.cpu_model(tmp_path / "missing") == "aarch64"
    monkeypatch.setattr(stamp_mod.platform, "machine", lambda: "")
    assert stamp_mod.cpu_model(tmp_path / "missing") == "unknown CPU"


def test_stamp_shows_the_cpu_model_and_nccl_version():
    s = environment_stamp()
    rows = dict(s.rows())
    assert s.cpu_model in rows["CPU"] and rows["NCCL"] == s.nccl
    if torch.distributed.is_nccl_available():
        assert s.nccl == ".".join(map(str, torch.cuda.nccl.version()))
    if s.gpu_count == 0:
        assert s.cpu_model in s.hardware
