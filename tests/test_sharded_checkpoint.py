"""Sharded (DCP) checkpoints under damage: every altered file is caught, and a checkpoint of
another model, a truncated shard, a missing metadata file or an emptied folder is one clear
error or a fall-back to the last complete checkpoint, never a silent load or a traceback."""

import random
import shutil

import pytest
import torch

from tutorial_utils.checkpoint import CheckpointError
from tutorial_utils.models.wrn import wide_resnet
from tutorial_utils.parallel.distributed import DistContext
from tutorial_utils.sharded_checkpoint import latest_checkpoint, load_sharded, save_sharded
from tutorial_utils.workers import dcp_resume

CPU = DistContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


def model_and_optimizer(name: str = "wrn-10-1", seed: int = 0):
    torch.manual_seed(seed)
    model = wide_resnet(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss = model(torch.randn(2, 3, 32, 32)).sum()
    loss.backward()
    opt.step()  # a momentum buffer per parameter
    return model, opt


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("dcp")
    model, opt = model_and_optimizer()
    return save_sharded(root, 3, model, opt, CPU), model


def fresh_copy(saved, tmp_path):
    path, _ = saved
    copy = tmp_path / path.name
    shutil.copytree(path, copy)
    return copy


def test_a_complete_checkpoint_loads_exactly(saved):
    path, written = saved
    model, opt = model_and_optimizer(seed=1)
    assert load_sharded(path, model, opt) == 3
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 written.state_dict().values(), strict=True))
    _, written_opt = model_and_optimizer(seed=0)  # the saved optimizer, built again
    _, other_opt = model_and_optimizer(seed=1)
    loaded, want, other = (o.state_dict()["state"] for o in (opt, written_opt, other_opt))
    assert len(loaded) == len(want) == len(list(model.parameters()))
    assert not torch.equal(want[0]["momentum_buffer"], other[0]["momentum_buffer"])
    assert all(torch.equal(loaded[i]["momentum_buffer"], want[i]["momentum_buffer"]) for i in want)


def test_no_flipped_bit_in_any_file_loads(saved, tmp_path):
    path = fresh_copy(saved, tmp_path)
    files = sorted(p for p in path.iterdir() if p.name != "digests.json")
    rng, loaded = random.Random(0), []
    model, opt = model_and_optimizer(seed=1)
    for _ in range(200):
        file = rng.choice(files)
        good = file.read_bytes()
        data = bytearray(good)
        k = rng.randrange(len(data))
        data[k] ^= 1 << rng.randrange(8)
        file.write_bytes(bytes(data))
        try:
            load_sharded(path, model, opt)
            loaded.append((file.name, k))
        except CheckpointError as err:
            assert "\n" not in str(err) and "does not match its digest" in str(err)
        file.write_bytes(good)
    assert not loaded


@pytest.mark.parametrize("damage", ["truncated shard", "no metadata", "no digests"])
def test_a_damaged_checkpoint_is_one_clear_error(saved, tmp_path, damage):
    path = fresh_copy(saved, tmp_path)
    shard = next(path.glob("*.distcp"))
    if damage == "truncated shard":
        shard.write_bytes(shard.read_bytes()[:100])
    elif damage == "no metadata":
        (path / ".metadata").unlink()
    else:
        (path / "digests.json").unlink()
    model, opt = model_and_optimizer(seed=1)
    with pytest.raises(CheckpointError) as err:
        load_sharded(path, model, opt)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_a_checkpoint_of_another_model_is_one_clear_error(saved):
    path, _ = saved
    model, opt = model_and_optimizer("wrn-10-2")
    with pytest.raises(CheckpointError, match="does not fit this model") as err:
        load_sharded(path, model, opt)
    assert "\n" not in str(err.value)


def test_an_emptied_newest_folder_falls_back_to_the_last_complete_one(saved, tmp_path):
    shutil.copytree(saved[0], tmp_path / "step-000003")
    (tmp_path / "step-000005").mkdir()  # emptied by hand, or copied in part
    assert latest_checkpoint(tmp_path).name == "step-000003"


def test_the_worker_reports_a_damaged_checkpoint_in_one_line(saved, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    path = fresh_copy(saved, ckpt)
    shard = next(path.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(SystemExit) as exit_:
        dcp_resume.main(["--ckpt", str(ckpt), "--out", str(tmp_path / "out.pt"), "--resume",
                         "--steps", "4"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("python -m tutorial_utils.workers.dcp_resume: error: ")
    assert "does not match its digest" in err and "\n" not in err


# --- step folders without digests: written before digests existed, or copied in part ---

def undigested_copy(saved, folder):
    """A complete DCP checkpoint, as a version of the program before digests wrote it."""
    shutil.copytree(saved[0], folder)
    (folder / "digests.json").unlink()
    return folder


def test_a_folder_without_digests_is_passed_over_with_a_line_saying_why(saved, tmp_path,
                                                                         capsys):
    shutil.copytree(saved[0], tmp_path / "step-000003")
    old = undigested_copy(saved, tmp_path / "step-000005")
    assert latest_checkpoint(tmp_path).name == "step-000003"
    said = capsys.readouterr().err.strip()
    assert said.startswith(f"{old} passed over: no digests.json (written before digests "
                           "existed, or copied in part)")
    assert "--accept-undigested" in said and "\n" not in said
    assert latest_checkpoint(tmp_path, quiet=True).name == "step-000003"  # other ranks
    assert capsys.readouterr().err == ""


def test_a_folder_without_digests_is_loaded_only_when_accepted(saved, tmp_path):
    old = undigested_copy(saved, tmp_path / "step-000003")
    assert latest_checkpoint(tmp_path) is None
    assert latest_checkpoint(tmp_path, accept_undigested=True) == old
    model, opt = model_and_optimizer(seed=1)
    with pytest.raises(CheckpointError, match="has no readable digests.json"):
        load_sharded(old, model, opt)
    assert load_sharded(old, model, opt, require_digests=False) == 3
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 saved[1].state_dict().values(), strict=True))


def test_pruning_deletes_only_what_a_save_wrote(saved, tmp_path, capsys):
    old = undigested_copy(saved, tmp_path / "step-000001")
    clash = undigested_copy(saved, tmp_path / "step-000004")  # the step a save will write
    model, opt = model_and_optimizer()
    for step in (2, 4, 6, 8):
        save_sharded(tmp_path, step, model, opt, CPU)
    names = sorted(p.name for p in tmp_path.iterdir())
    # the last two saves kept; the folders no save wrote kept too, the clashing one renamed
    assert names == ["step-000001", "step-000004.undigested", "step-000006", "step-000008"]
    assert sorted(p.name for p in old.iterdir()) == sorted(
        p.name for p in (tmp_path / "step-000004.undigested").iterdir())
    assert f"{clash} has no digests.json" in capsys.readouterr().err


def test_the_worker_resumes_a_folder_without_digests_when_told_to(saved, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    undigested_copy(saved, ckpt / "step-000003")
    args = ["--ckpt", str(ckpt), "--out", str(tmp_path / "out.pt"), "--resume", "--steps", "4",
            "--save-every", "0"]
    dcp_resume.main(args)
    assert '"start_step": 0' in capsys.readouterr().out  # passed over, and said so
    dcp_resume.main([*args, "--accept-undigested"])
    assert '"start_step": 3' in capsys.readouterr().out


# --- loading runs the pickle in .metadata: only folders nobody else can change ---

@pytest.mark.parametrize("where", ["folder", ".metadata", "shard"])
def test_a_checkpoint_others_can_write_to_is_refused(saved, tmp_path, where):
    path = fresh_copy(saved, tmp_path)
    target = {"folder": path, ".metadata": path / ".metadata",
              "shard": next(path.glob("*.distcp"))}[where]
    target.chmod(target.stat().st_mode | 0o020)  # group-writable
    model, opt = model_and_optimizer(seed=1)
    with pytest.raises(CheckpointError) as err:
        load_sharded(path, model, opt)
    said = str(err.value)
    assert said.startswith(f"{target} can be written by other users") and "\n" not in said
    assert "pickle" in said and f"chmod -R go-w {path}" in said


def test_a_save_under_a_permissive_umask_can_be_loaded(tmp_path):
    import os

    model, opt = model_and_optimizer()
    old = os.umask(0o002)  # common for users with a group of their own
    try:
        path = save_sharded(tmp_path, 2, model, opt, CPU)
    finally:
        os.umask(old)
    assert load_sharded(path, *model_and_optimizer(seed=1)) == 2


# --- the worker's command line: one line, or what was asked ---

def test_the_worker_refuses_a_ckpt_that_names_a_file(tmp_path, capsys):
    file = tmp_path / "ckpt.pt"
    file.write_bytes(b"")
    with pytest.raises(SystemExit) as exit_:
        dcp_resume.main(["--ckpt", str(file), "--out", str(tmp_path / "out.pt"), "--resume"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip() == (
        f"python -m tutorial_utils.workers.dcp_resume: error: --ckpt {file} is a file; name "
        "the folder of the step-N checkpoints")


def test_the_worker_creates_the_folder_of_its_out_and_says_when_nothing_resumes(tmp_path,
                                                                                capsys):
    out = tmp_path / "not" / "yet" / "out.pt"
    dcp_resume.main(["--ckpt", str(tmp_path / "ckpt"), "--out", str(out), "--resume",
                     "--steps", "1", "--save-every", "0"])
    assert out.is_file()
    assert f"--resume: no complete checkpoint in {tmp_path / 'ckpt'} yet; training from " \
           "step 1" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without GPUs")
def test_the_worker_asked_for_a_gpu_on_a_cpu_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        dcp_resume.main(["--ckpt", str(tmp_path), "--out", str(tmp_path / "o.pt"),
                         "--device", "cuda"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("python -m tutorial_utils.workers.dcp_resume: error: --device cuda")
    assert "\n" not in err
