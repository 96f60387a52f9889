"""Multi-process runs on the CPU (gloo): the same code path torchrun takes on GPUs."""

import pytest
import torch

from tutorial_utils.launch import torchrun
from tutorial_utils.parallel.distributed import DistContext, all_reduce_sum, distributed


def test_single_process_needs_no_process_group(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with distributed("cpu") as ctx:
        assert ctx == DistContext(0, 0, 1, torch.device("cpu"))
        assert ctx.is_main and not ctx.is_distributed
        assert all_reduce_sum(ctx, 1.0, 2.0) == [1.0, 2.0]
        assert not torch.distributed.is_initialized()


def test_two_process_training_run(tmp_path):
    out = tmp_path / "run"
    result = torchrun(
        "tutorial_utils.train",
        ["--depth", "10", "--width", "1", "--epochs", "1", "--batch", "64", "--data", "synthetic",
         "--limit-per-class", "50", "--device", "cpu", "--precision", "fp32", "--out", str(out)],
        nproc=2, timeout_s=300, metrics_file=out / "metrics.jsonl", echo=False,
    )
    start, epoch = result.metrics
    assert start["world_size"] == 2 and start["per_gpu_batch"] == 32
    assert start["synthetic_data"] is True
    assert epoch["epoch"] == 1 and 0 <= epoch["test_acc"] <= 1
    assert (out / "checkpoint.pt").exists()


def _ddp_script(tmp_path, nproc: int) -> dict:
    """Chapter 4's complete DDP script, run as the chapter runs it; rank 0's JSON line."""
    import json

    result = torchrun("tutorial_utils.workers.ddp_minimal", ["--out", str(tmp_path / "ddp")],
                      nproc=nproc, timeout_s=300, echo=False)
    line = next(x for x in result.output.splitlines() if '"world_size"' in x)
    return json.loads(line[line.index("{"):])


def test_the_complete_ddp_script_trains_on_two_cpu_processes(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # whatever the machine has
    record = _ddp_script(tmp_path, 2)
    assert (record["world_size"], record["device"]) == (2, "cpu")
    assert len(record["losses"]) == 2 and all(0 < v < 10 for v in record["losses"])
    assert torch.load(tmp_path / "ddp" / "checkpoint.pt", weights_only=True)["epoch"] == 1


@pytest.mark.gpu
def test_the_complete_ddp_script_with_more_processes_than_gpus_runs_on_the_cpu(tmp_path):
    # one GPU per process, or none: with one GPU, two processes would both ask for GPU 1 too
    record = _ddp_script(tmp_path, torch.cuda.device_count() + 1)
    assert record["device"] == "cpu"


@pytest.mark.multigpu
def test_two_gpu_nccl_training_run(tmp_path):
    out = tmp_path / "run"
    result = torchrun(
        "tutorial_utils.train",
        ["--depth", "10", "--width", "1", "--epochs", "1", "--batch", "128", "--data",
         "synthetic", "--device", "cuda", "--out", str(out)],
        nproc=2, timeout_s=300, metrics_file=out / "metrics.jsonl", echo=False,
    )
    start, epoch = result.metrics
    assert start["world_size"] == 2 and start["stamp"]["gpu_count"] >= 2
    assert (start["per_gpu_batch"], start["global_batch"]) == (64, 128)  # strong scaling
    assert epoch["epoch"] == 1 and 0 <= epoch["test_acc"] <= 1


@pytest.mark.multigpu
def test_two_gpu_step_graph_trains_like_the_eager_step(tmp_path):
    losses = []
    for name, flags in (("eager", []), ("graphed", ["--step-graph"])):
        out = tmp_path / name
        result = torchrun(
            "tutorial_utils.train",
            ["--depth", "10", "--width", "1", "--epochs", "2", "--batch", "128", "--data",
             "synthetic", "--device", "cuda", "--deterministic", "--out", str(out), *flags],
            nproc=2, timeout_s=300, metrics_file=out / "metrics.jsonl", echo=False,
        )
        losses.append([r["train_loss"] for r in result.metrics if r["event"] == "epoch"])
    eager, graphed = losses
    assert graphed == pytest.approx(eager, rel=1e-3)  # the all-reduce ran inside the graph
    a, b = (torch.load(tmp_path / n / "checkpoint.pt", weights_only=True)["model"]
            for n in ("eager", "graphed"))
    for k in a:
        if a[k].is_floating_point():
            assert (a[k] - b[k]).norm() <= 1e-2 * a[k].norm() + 1e-6, k


def _equivalence(tmp_path, *flags, device="cpu"):
    out = tmp_path / "eq.jsonl"
    result = torchrun("tutorial_utils.workers.equivalence",
                      ["--out", str(out), "--device", device, *flags],
                      nproc=2, timeout_s=120, metrics_file=out, echo=False)
    (row,) = result.metrics
    return row


def test_ddp_and_hand_written_all_reduce_match_one_process(tmp_path):
    row = _equivalence(tmp_path)
    assert set(row) >= {"ddp_vs_reference", "manual_vs_ddp", "no_sync_vs_reference"}
    assert row["world_size"] == 2
    assert row["ddp_vs_reference"] < 1e-6
    assert row["manual_vs_ddp"] < 1e-6
    assert row["no_sync_vs_reference"] < 1e-6


def test_bucketed_all_reduce_during_backward_matches_ddp(tmp_path):
    row = _equivalence(tmp_path)
    assert row["bucketed_vs_ddp"] < 1e-6  # the same sums, sent bucket by bucket in backward


def test_batchnorm_breaks_exact_equality(tmp_path):
    row = _equivalence(tmp_path, "--batchnorm")
    assert row["ddp_vs_reference"] > 1e-4  # per-rank batch statistics differ from the global ones


@pytest.mark.multigpu
def test_sync_batchnorm_restores_equality_on_gpus(tmp_path):
    row = _equivalence(tmp_path, "--sync-bn", device="cuda")
    assert row["ddp_vs_reference"] < 1e-4
