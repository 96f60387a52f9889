"""Checkpoints: any damage is one clear error, and a save is atomic and durable."""

import pickle
import random
import struct
import zipfile
from pathlib import Path

import pytest
import torch

from tutorial_utils import checkpoint as ckpt
from tutorial_utils.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from tutorial_utils.launch import torchrun
from tutorial_utils.parallel.distributed import DistContext

CPU = torch.device("cpu")
WORKERS = Path(__file__).parent / "workers"


def a_state(epoch: int = 3) -> dict:
    return {"model": {"w": torch.arange(1000, dtype=torch.float32)}, "epoch": epoch,
            "rng": [ckpt.rng_state(CPU)], "config": {"depth": 10}, "world_size": 1}


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, a_state())
    return path


def assert_one_clear_line(err: pytest.ExceptionInfo, path) -> None:
    msg = str(err.value)
    assert str(path) in msg and "delete it" in msg and "another --out" in msg, msg
    assert "\n" not in msg, msg


def damages(good: bytes) -> dict[str, bytes]:
    n = len(good)
    cases = {f"truncated at {k}": good[:k] for k in (1, 4, 30, 100, n // 2, n - 22, n - 1)}
    # a flipped byte in the pickled structure reads back as UnicodeDecodeError, KeyError...
    cases.update({f"byte {k} flipped": good[:k] + bytes([good[k] ^ 0xFF]) + good[k + 1:]
                  for k in range(60, 160, 5)})
    cases["zero-length"] = b""
    cases["random bytes"] = random.Random(0).randbytes(5000)
    cases["a text file"] = b"hello world\n" * 100
    cases["a plain pickle"] = pickle.dumps({"epoch": 1})
    return cases


def test_any_damage_is_a_checkpoint_error_naming_the_file(saved, tmp_path):
    path = tmp_path / "damaged.pt"
    escaped, loaded = {}, []
    for name, data in damages(saved.read_bytes()).items():
        path.write_bytes(data)
        try:
            state = load_checkpoint(path, {})
        except CheckpointError as err:
            msg = str(err)
            assert str(path) in msg and "delete it" in msg and "another --out" in msg, msg
            assert "\n" not in msg, msg
        except Exception as err:  # noqa: BLE001 - the test is that nothing else gets out
            escaped[name] = type(err).__name__
        else:  # a flipped byte in the archive's padding changes nothing that is read
            assert torch.equal(state["model"]["w"], a_state()["model"]["w"]), name
            loaded.append(name)
    assert not escaped
    assert all(name.endswith("flipped") for name in loaded), loaded


def test_a_pickle_that_is_not_a_dict_is_not_a_checkpoint(tmp_path):
    path = tmp_path / "list.pt"
    torch.save([1, 2, 3], path)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path, {})
    assert_one_clear_line(err, path)


def flipped(path, k: int):
    data = bytearray(path.read_bytes())
    data[k] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_flipped_byte_in_a_tensor_is_caught_by_the_crc(saved):
    weights = a_state()["model"]["w"]
    start = saved.read_bytes().find(weights.numpy().tobytes())
    assert start > 0
    flipped(saved, start + weights.numel() * weights.element_size() // 2)
    # the test can fail: torch's own reader loads the altered weights without a word
    altered = torch.load(saved, weights_only=True)["model"]["w"]
    assert not torch.equal(altered, weights)
    with pytest.raises(CheckpointError, match=r"data/0") as err:
        load_checkpoint(saved, {})
    assert_one_clear_line(err, saved)


def members(path) -> list[range]:
    """Where each member's bytes lie in the archive (past its local header)."""
    data = path.read_bytes()
    with zipfile.ZipFile(path) as archive:
        infos = archive.infolist()
    spans = []
    for info in infos:
        name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)
        start = info.header_offset + 30 + name_len + extra_len
        spans.append(range(start, start + info.compress_size))
    return spans


def test_no_flipped_byte_in_any_member_loads_silently(saved):
    # flips in the zip's own bookkeeping (timestamps, padding) may load: they alter nothing
    good = saved.read_bytes()
    loaded = []
    for span in members(saved):
        for k in span[::7]:
            saved.write_bytes(good)
            flipped(saved, k)
            try:
                load_checkpoint(saved, {})
            except CheckpointError:
                continue
            loaded.append(k)
    assert not loaded


def test_missing_required_keys_are_named(saved):
    with pytest.raises(CheckpointError, match="optimizer, scheduler") as err:
        load_checkpoint(saved, {}, required=("model", "optimizer", "scheduler", "epoch"))
    assert_one_clear_line(err, saved)
    assert load_checkpoint(saved, {}, required=("model", "epoch"))["epoch"] == 3


def test_the_folder_is_fsynced_after_the_rename(tmp_path, syncs):
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, a_state())
    file, folder = path.stat().st_ino, tmp_path.stat().st_ino
    assert syncs == [("fsync", file), ("replace", file), ("fsync", folder)]


def test_two_writers_never_share_a_temp_file(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.pt"
    real_save = torch.save

    def interleaved(obj, f):
        real_save(obj, f)
        if obj["epoch"] == 1:  # a second writer saves between this one's write and rename
            save_checkpoint(path, a_state(epoch=2))

    monkeypatch.setattr(ckpt.torch, "save", interleaved)
    save_checkpoint(path, a_state(epoch=1))
    assert load_checkpoint(path, {})["epoch"] == 1  # the last rename wins, whole
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]


def test_a_failed_save_keeps_the_previous_checkpoint_and_no_temp_file(saved, tmp_path):
    with pytest.raises(Exception, match="pickle"):
        save_checkpoint(saved, {**a_state(epoch=4), "hook": lambda: None})
    assert load_checkpoint(saved, {})["epoch"] == 3
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]


def test_one_process_resumes_its_own_rng_state():
    ctx = DistContext(rank=0, local_rank=0, world_size=1, device=CPU)
    torch.manual_seed(5)
    random.seed(5)
    saved = ckpt.gather_rng_states(ctx)
    drawn = (torch.rand(4), random.random())
    torch.manual_seed(6)
    random.seed(6)
    ckpt.set_rng_state(ckpt.rng_state_for_rank(saved, 0), CPU)
    assert len(saved) == 1
    assert torch.equal(torch.rand(4), drawn[0]) and random.random() == drawn[1]


def test_a_rank_with_no_saved_rng_state_is_a_checkpoint_error():
    with pytest.raises(CheckpointError, match="rank 1"):
        ckpt.rng_state_for_rank([ckpt.rng_state(CPU)], 1)
    with pytest.raises(CheckpointError, match="rank 0"):  # one state for all, as saved before
        ckpt.rng_state_for_rank(ckpt.rng_state(CPU), 0)


def test_two_processes_each_resume_their_own_rng_state(tmp_path):
    result = torchrun(str(WORKERS / "rng_states.py"), [str(tmp_path / "checkpoint.pt")],
                      nproc=2, timeout_s=300, echo=False)
    assert "rng_states ok" in result.output


def test_a_resume_at_another_world_size_is_refused(saved):
    with pytest.raises(CheckpointError) as err:
        ckpt.check_world_size({"world_size": 2}, 1, saved)
    msg = str(err.value)
    assert msg.startswith(f"{saved} was written by 2 processes, this run has 1: the per-GPU batch")
    assert "peak learning rate" in msg and msg.endswith(
        "resume with 2 processes, or start afresh with another --out")
    with pytest.raises(CheckpointError, match="does not record"):
        ckpt.check_world_size({}, 1, saved)
    ckpt.check_world_size({"world_size": 2}, 2, saved)
    ckpt.check_world_size(load_checkpoint(saved, {}), 1)


def swapped_members(path: Path, a: str, b: str) -> None:
    """Rewrite ``path`` with the bytes of members ``a`` and ``b`` swapped: valid CRCs."""
    with zipfile.ZipFile(path) as archive:
        content = {i.filename: archive.read(i) for i in archive.infolist()}
    root = next(iter(content)).split("/", 1)[0]
    first, second = f"{root}/{a}", f"{root}/{b}"
    content[first], content[second] = content[second], content[first]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        for name, data in content.items():
            archive.writestr(name, data)


def test_a_well_formed_archive_with_swapped_tensors_is_refused(tmp_path):
    path = tmp_path / "checkpoint.pt"
    weight, momentum = torch.arange(1000.0), -torch.arange(1000.0)
    save_checkpoint(path, {"model": {"w": weight}, "optimizer": {"m": momentum}, "epoch": 1})
    swapped_members(path, "data/0", "data/1")
    # the test can fail: the archive passes every CRC and torch loads the swap without a word
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() is None
    assert torch.equal(torch.load(path, weights_only=True)["model"]["w"], momentum)
    with pytest.raises(CheckpointError, match="does not match the digest") as err:
        load_checkpoint(path, {})
    assert_one_clear_line(err, path)


def test_a_checkpoint_without_a_digest_is_refused(tmp_path):
    path = tmp_path / "checkpoint.pt"
    torch.save(a_state(), path)
    with pytest.raises(CheckpointError, match="no digest"):
        load_checkpoint(path, {})


def test_a_damaged_member_is_named_without_the_writer_temporary_name(saved):
    weights = a_state()["model"]["w"]
    flipped(saved, saved.read_bytes().find(weights.numpy().tobytes()) + 100)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(saved, {})
    assert "its member data/0 fails its CRC check" in str(err.value)
    assert ".tmp" not in str(err.value)


KILLED_WRITER = """
import os, signal, sys
import torch
from tutorial_utils import checkpoint as ckpt

def dies_midway(obj, f):
    f.write(b"the first bytes of a checkpoint")
    f.flush()
    os.kill(os.getpid(), signal.SIGKILL)  # no finally, no cleanup: a real kill

ckpt.torch.save = dies_midway
ckpt.save_checkpoint(ckpt.Path(sys.argv[1]), {"epoch": 2})
"""


def test_a_writer_killed_mid_write_leaves_a_file_the_next_save_removes(saved, tmp_path):
    import subprocess
    import sys

    died = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(saved)])
    assert died.returncode == -9
    left = sorted(p.name for p in tmp_path.iterdir())
    assert len(left) == 2 and left[0].startswith(".checkpoint.pt.")  # the killed writer's
    assert load_checkpoint(saved, {})["epoch"] == 3
    save_checkpoint(saved, a_state(epoch=4))
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]


def test_a_stale_temporary_that_cannot_be_removed_does_not_stop_the_save(saved, tmp_path,
                                                                          monkeypatch):
    import socket
    import subprocess
    import sys

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    stale = tmp_path / f".checkpoint.pt.{gone.stdout.strip()}.{socket.gethostname()}.x.tmp"
    stale.write_bytes(b"left by a writer that was killed")
    real_unlink = Path.unlink

    def unlink(self, missing_ok=False):  # e.g. owned by another user in a sticky folder
        if self == stale:
            raise PermissionError(13, "Permission denied", str(self))
        real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", unlink)
    save_checkpoint(saved, a_state(epoch=4))
    assert load_checkpoint(saved, {})["epoch"] == 4
    assert stale.exists()  # left where it was: not this writer's to remove
