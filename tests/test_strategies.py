"""The training entry point under every strategy: DDP, FSDP2, HSDP and FSDP2 x TP train the GPT
and the Wide-ResNet as one process does; the sharded ones save with DCP asynchronously, and a
job killed while a save is written resumes, on any number of processes and any layout, to the
weights of a straight run; bad combinations end in one line."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tutorial_utils
from tutorial_utils.config import ConfigError, parse
from tutorial_utils.jsonl import read_jsonl
from tutorial_utils.launch import LaunchError, torchrun
from tutorial_utils.models.gpt import GPT, GPTConfig
from tutorial_utils.parallel.distributed import DistContext
from tutorial_utils.parallel.strategy import check_layout
from tutorial_utils.sharded_checkpoint import DIGESTS, latest_checkpoint, load_sharded
from tutorial_utils.train import main, run
from tutorial_utils.trainer import SAVE_CRASH_ENV, TrainConfig

CPU = DistContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
WORKERS = Path(__file__).parent / "workers"
SHAPE = ["--model", "gpt", "--dim", "32", "--layers", "2", "--heads", "4", "--seq", "32"]
# 3 epochs of 2 steps, a checkpoint after each (steps 2, 4 and 6)
GPT_ARGS = [*SHAPE, "--batch", "8", "--epochs", "3", "--epoch-steps", "2", "--data", "synthetic",
       "--device", "cpu", "--precision", "fp32", "--schedule", "cosine", "--clip-norm", "1.0",
       "--gpt-lr", "3e-3"]
FSDP2 = [*GPT_ARGS, "--strategy", "fsdp2"]


@pytest.fixture(autouse=True)
def no_faults(monkeypatch):
    for name in ("TUTORIAL_CRASH_AT_STEP", SAVE_CRASH_ENV):
        monkeypatch.delenv(name, raising=False)


def cfg_of(*argv: str) -> TrainConfig:
    return parse(TrainConfig, list(argv), "train")


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    """The GPT's weights in the newest checkpoint under ``out``, whatever job wrote it."""
    model = GPT(GPTConfig(dim=32, layers=2, heads=4, seq=32))
    load_sharded(latest_checkpoint(out / "checkpoints"), model,
                 torch.optim.AdamW(model.parameters()), no_dist=True)
    return model.state_dict()


def initial_weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)  # --seed 0, as the trainer draws them
    return GPT(GPTConfig(dim=32, layers=2, heads=4, seq=32)).state_dict()


def flat(a: dict, b: dict) -> torch.Tensor:
    """Every weight of ``a`` minus ``b``'s, in one vector."""
    return torch.cat([(a[k] - b[k]).flatten() for k in a])


@pytest.mark.parametrize("nproc", [2, 4])
def test_each_strategy_trains_as_one_process_does(tmp_path, nproc):
    out = tmp_path / "rows.jsonl"
    torchrun(str(WORKERS / "strategies_match.py"), [str(out), str(tmp_path)], nproc=nproc,
             timeout_s=300, echo=False)
    rows = {(r["model"], r["strategy"]): r for r in read_jsonl(out)}
    hsdp = f"hsdp, --shard-size {nproc // 2}"  # 2 x 1 on 2 processes, 2 x 2 on 4
    assert set(rows) == {("gpt", s) for s in ("ddp", "fsdp2", "fsdp2, --grad-accum 2",
                                              "fsdp2, --no-reshard-after-forward", hsdp,
                                              "fsdp2, --tp 2")} | \
        {("wrn", s) for s in ("ddp", "fsdp2", "fsdp2, --grad-accum 2", hsdp)}
    # fp32 on CPU processes: the same arithmetic as one process, the sums in another order
    # (each rank's rows, then the reduce-scatter or all-reduce). Seen: about 1e-7 of the loss,
    # of the largest gradient and of a weight; a missing all-reduce or a wrong scale is off by
    # far more than 1e-5 (half the gradient, or all of it).
    for (model, strategy), r in rows.items():
        where = f"{model} under {strategy}: {r}"
        assert r["loss"] < 1e-5, where
        if model == "gpt":  # gradients, clipped to a global norm of 0.05 over all shards
            assert r["norm"] < 1e-5 and r["grads"] < 1e-5, where
        else:  # the weights after one SGD step that moved them by `update`
            assert r["weights"] < 1e-6 < 1e-4 < r["update"], where
            assert r.get("stats", 0) < 1e-5, where  # rank 0's BatchNorm statistics
            assert r.get("restored", 0) == 0, where  # saved by DCP and restored: exactly


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """One process trains the GPT under fsdp2 for 3 epochs, saving after each."""
    out = tmp_path_factory.mktemp("straight")
    records = run(cfg_of(*FSDP2, "--out", str(out)), CPU)
    return out, records


def test_the_metrics_line_gives_what_an_asynchronous_save_held_the_step(straight, capsys):
    out, records = straight
    for record in records:  # each epoch saved: the copy it waited for, and a step for scale
        assert record["save_stall_s"] > 0 and record["step_s"] > 0
    written = [r for r in read_jsonl(out / "metrics.jsonl") if r["event"] == "epoch"]
    assert [r["save_stall_s"] for r in written] == [r["save_stall_s"] for r in records]
    start = read_jsonl(out / "metrics.jsonl")[0]
    assert start["config"]["strategy"] == "fsdp2" and start["mesh"] is None  # one process
    # the last two saves are kept, each with the digests of its files
    steps = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert steps == ["step-000004", "step-000006"]
    assert all((out / "checkpoints" / s / DIGESTS).is_file() for s in steps)


def test_the_metrics_line_is_printed(tmp_path, capsys):
    run(cfg_of(*FSDP2, "--epochs", "1", "--out", str(tmp_path)), CPU)
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("epoch   1/1") and " tok/s  loss " in line and "  val " in line
    assert " ms held (a step " in line


def killed_in_save(out: Path, nproc: int) -> str:
    """Train FSDP2 in ``out`` on ``nproc`` processes, the last one killed while the save of
    epoch 2 is written; the output."""
    if nproc == 1:  # no torchrun: one process, killed
        env = {"PYTHONPATH": str(Path(tutorial_utils.__file__).parents[1]),
               "OMP_NUM_THREADS": str(torch.get_num_threads()), SAVE_CRASH_ENV: "2"}
        import os

        done = subprocess.run([sys.executable, "-m", "tutorial_utils.train", *FSDP2, "--out",
                               str(out)], env={**os.environ, **env}, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == -9, done.stderr
        output = done.stdout
    else:
        with pytest.raises(LaunchError) as err:
            torchrun("tutorial_utils.train", [*FSDP2, "--out", str(out)], nproc=nproc,
                     timeout_s=300, env={SAVE_CRASH_ENV: "2"}, echo=False)
        output = err.value.output
    assert f"rank {nproc - 1}: simulated crash while its save of epoch 2 is written" in output
    # the save of epoch 1 committed; that of epoch 2 left in its temporary folder
    folder = out / "checkpoints"
    assert (folder / "step-000002" / DIGESTS).is_file() and (folder / ".step-000004.tmp").is_dir()
    assert not (folder / "step-000004").exists()
    return output


def test_a_kill_while_an_asynchronous_save_is_written_resumes_bitwise(straight, tmp_path):
    killed_in_save(tmp_path, 1)
    records = run(cfg_of(*FSDP2, "--out", str(tmp_path), "--resume"), CPU)
    assert [r["epoch"] for r in records] == [2, 3]
    a, b = final_weights(straight[0]), final_weights(tmp_path)
    assert all(torch.equal(a[k], b[k]) for k in a)
    epochs = [r["epoch"] for r in read_jsonl(tmp_path / "metrics.jsonl") if r["event"] == "epoch"]
    assert epochs == [1, 2, 3]


def test_saved_by_two_processes_resumed_by_one_and_by_four_with_another_layout(
        straight, tmp_path):
    killed_in_save(tmp_path / "two", 2)
    shutil.copytree(tmp_path / "two", tmp_path / "four")  # the same checkpoints, twice
    one = run(cfg_of(*FSDP2, "--out", str(tmp_path / "two"), "--resume"), CPU)
    assert [r["epoch"] for r in one] == [2, 3]
    # four processes, a 2 x 2 mesh: FSDP2 over two groups of two tensor-parallel processes
    result = torchrun("tutorial_utils.train", [*FSDP2, "--out", str(tmp_path / "four"),
                                               "--resume", "--tp", "2"],
                      nproc=4, timeout_s=300, metrics_file=None, echo=False)
    starts = [r for r in read_jsonl(tmp_path / "four" / "metrics.jsonl") if r["event"] == "start"]
    assert [(s["world_size"], s["start_epoch"], s["mesh"]) for s in starts] == \
        [(2, 0, {"shard": 2}), (4, 1, {"dp": 2, "tp": 2})], result.output
    reference, start = final_weights(straight[0]), initial_weights()
    # The same global batch of the same windows, the same steps: only the order of the sums
    # differs (fp32; one process against two, then four). AdamW divides each gradient by its
    # own running magnitude: where a gradient is near zero, a rounding difference moves its
    # weight by a fair part of a learning rate (3e-3). Seen: 2 weights of 42,880 off by 1e-4,
    # the rest within 1e-5; the difference 1e-4 of the distance the weights moved. A lost
    # epoch, optimizer state or schedule is off by a good part of that distance, everywhere.
    for out in ("two", "four"):
        weights = final_weights(tmp_path / out)
        moved, off = flat(reference, start), flat(weights, reference)
        assert off.norm() < 1e-3 * moved.norm(), out
        assert (off.abs() > 1e-5).float().mean() < 1e-3, out


def error_of(capsys, *argv) -> str:
    capsys.readouterr()
    try:
        code = main(list(argv))
    except SystemExit as exit_:
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after any data warning
    assert err.startswith("python -m tutorial_utils.train: error: "), err
    return err


@pytest.mark.parametrize(("argv", "message"), [
    (["--tp", "2"], "--tp splits the GPT's attention heads and MLP over processes; the "
     "Wide-ResNet has no tensor-parallel plan: leave --tp out, or use --model gpt"),
    ([*GPT_ARGS, "--tp", "2"], "--tp 2 builds a 2-D mesh, FSDP2 x tensor parallel: use it with "
     "--strategy fsdp2"),
    ([*FSDP2, "--tp", "3"], "--tp 3 must divide the 4 attention heads (each process computes "
     "whole heads); use a --tp that divides 4"),
    ([*FSDP2, "--tp", "2"], "--tp 2 does not divide the 1 process; run a multiple of 2 "
     "processes, or use a --tp that divides 1 (1)"),
    ([*GPT_ARGS, "--strategy", "hsdp", "--shard-size", "2"], "--strategy hsdp --shard-size 2: the "
     "mesh's shard dimension must divide the 1 process; use --shard-size 1"),
    ([*FSDP2, "--shard-size", "2"], "--shard-size sets the shard dimension of HSDP's mesh: use "
     "it with --strategy hsdp"),
    (["--strategy", "fsdp2", "--precision", "fp16"], "--strategy fsdp2 runs no fp16 gradient "
     "scaler here: use --precision bf16 (or fp32)"),
    ([*GPT_ARGS, "--lr", "0.01", "--tta"], "--lr, --tta: Wide-ResNet settings, which --model gpt "
     "does not use"),
    ([*GPT_ARGS, "--data", "cifar.tar.gz"], "--model gpt trains on --data auto"),
])
def test_bad_combinations_end_in_one_line(capsys, argv, message):
    assert message in error_of(capsys, *argv)


def test_hsdp_needs_a_shard_size_that_divides_the_processes():
    with pytest.raises(ConfigError, match=r"--shard-size 3: the mesh's shard dimension must "
                       r"divide the 4 processes; use --shard-size 1 or 2 or 4$"):
        check_layout("hsdp", 4, shard=3)
    check_layout("hsdp", 4, shard=2)  # 2 x 2


def test_a_resume_under_another_strategy_is_refused_in_one_line(straight, tmp_path, capsys):
    sharded = tmp_path / "sharded"
    shutil.copytree(straight[0], sharded)
    err = error_of(capsys, *GPT_ARGS, "--out", str(sharded), "--resume")  # ddp
    assert "strategy=fsdp2 (this run: ddp); use the same settings or another --out" in err
    run(cfg_of(*GPT_ARGS, "--epochs", "1", "--out", str(tmp_path / "ddp")), CPU)
    err = error_of(capsys, *GPT_ARGS, "--epochs", "1", "--strategy", "hsdp", "--out",
                   str(tmp_path / "ddp"), "--resume")
    assert err.endswith("checkpoint.pt was written with strategy=ddp (this run: hsdp); use the "
                        "same settings or another --out")


def test_help_lists_the_strategies(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for option in ("--model {wrn,gpt}", "--strategy {ddp,fsdp2,hsdp}", "--tp TP",
                   "--shard-size SHARD_SIZE", "--reshard-after-forward", "--async-save"):
        assert option in text, option
