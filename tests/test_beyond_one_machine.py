"""Beyond one machine, on the CPU: two "nodes" via c10d rendezvous, a killed worker that
torchrun restarts and that resumes from the checkpoint, and a collective that times out.
FSDP and its sharded checkpoints are tested in test_fsdp.py."""

import pytest
import torch

from tutorial_utils.launch import LaunchError, torchrun
from tutorial_utils.multinode import launcher_command, simulate_nodes
from tutorial_utils.trainer import CRASH_ENV

TINY = ["--depth", "10", "--width", "1", "--batch", "64", "--data", "synthetic",
        "--limit-per-class", "100", "--device", "cpu", "--precision", "fp32"]


def test_launcher_command_is_the_same_on_every_node():
    cmd = launcher_command("tutorial_utils.train", ["--epochs", "1"], nnodes=2, nproc_per_node=4,
                           endpoint="head:29400", job_id="j1")
    assert "--nnodes=2" in cmd and "--rdzv-backend=c10d" in cmd
    assert "--rdzv-endpoint=head:29400" in cmd and cmd[-4:] == ["-m", "tutorial_utils.train",
                                                                 "--epochs", "1"]


def test_two_node_training_run(tmp_path):
    out = tmp_path / "run"
    result = simulate_nodes("tutorial_utils.train", [*TINY, "--epochs", "1", "--out", str(out)],
                            nnodes=2, timeout_s=300, metrics_file=out / "metrics.jsonl",
                            echo=False)
    start, epoch = result.metrics
    assert start["world_size"] == 2 and epoch["epoch"] == 1


def test_killed_worker_is_restarted_and_resumes_to_the_same_weights(tmp_path):
    straight, faulty = tmp_path / "straight", tmp_path / "faulty"
    torchrun("tutorial_utils.train", [*TINY, "--epochs", "2", "--out", str(straight)],
             nproc=2, timeout_s=300, echo=False)
    # 1000 synthetic images / 64 per step = 16 steps per epoch: step 20 is inside epoch 2.
    # Restarted workers must not share the rendezvous store of the failed attempt: gloo would
    # find the dead rank 0's address there and fail to connect (seen with torch 2.14).
    result = torchrun(
        "tutorial_utils.train",
        [*TINY, "--epochs", "2", "--out", str(faulty), "--resume"],
        nproc=2, timeout_s=300, torchrun_args=("--standalone", "--max-restarts=1"),
        env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", CRASH_ENV: "20"},
        metrics_file=faulty / "metrics.jsonl", echo=False,
    )
    assert "simulated crash at step 20" in result.output
    starts = [m["start_epoch"] for m in result.metrics if m["event"] == "start"]
    assert starts == [0, 1], "the restarted job must resume after the last complete epoch"
    a = torch.load(straight / "checkpoint.pt", weights_only=True)["model"]
    b = torch.load(faulty / "checkpoint.pt", weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_without_restarts_the_crash_is_reported(tmp_path):
    with pytest.raises(LaunchError, match="rank 1 failed"):
        torchrun("tutorial_utils.train",
                 [*TINY, "--epochs", "1", "--out", str(tmp_path)],
                 nproc=2, timeout_s=300, env={CRASH_ENV: "3"}, echo=False)


def test_a_collective_one_rank_never_joins_times_out_clearly():
    with pytest.raises(LaunchError) as err:
        torchrun("tutorial_utils.workers.hang_demo", ["--timeout", "5", "--device", "cpu"],
                 nproc=2, timeout_s=120, echo=False)
    # Ended by the process group's timeout in rank 0's all-reduce, not by the launcher's outer
    # limit (whose error reads "timed out after 120 s; all processes were killed"). No bound on
    # the wall time: on a loaded machine starting the processes alone can take a minute.
    assert str(err.value).startswith("rank 0 failed: RuntimeError:")
    assert "Timed out" in str(err.value) and "all processes were killed" not in str(err.value)


@pytest.mark.multigpu
def test_two_node_nccl_run_one_gpu_per_node(tmp_path):
    out = tmp_path / "run"
    result = simulate_nodes(
        "tutorial_utils.train",
        ["--depth", "10", "--width", "1", "--batch", "128", "--data", "synthetic", "--device",
         "cuda", "--epochs", "1", "--out", str(out)],
        nnodes=2, timeout_s=300, metrics_file=out / "metrics.jsonl", echo=False)
    start, epoch = result.metrics
    assert start["world_size"] == 2 and epoch["images_per_s"] > 0
