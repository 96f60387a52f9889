"""FSDP2 and the ZeRO stages against DDP, and sharded checkpoints that outlive the job shape.

The multi-process tests run two CPU processes over gloo on small Wide-ResNets; the GPU
variants skip without two GPUs.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from tutorial_utils.bench import mfu, sharding
from tutorial_utils.bench.workers import common, fsdp_step
from tutorial_utils.config import ConfigError
from tutorial_utils.jsonl import read_jsonl
from tutorial_utils.launch import torchrun
from tutorial_utils.models.wrn import wide_resnet
from tutorial_utils.parallel.distributed import DistContext
from tutorial_utils.parallel.fsdp import shard, wrn_units
from tutorial_utils.sharded_checkpoint import commit, latest_checkpoint
from tutorial_utils.workers.dcp_resume import KILL_ENV

SHARDED = ("zero2", "zero3", "zero3-blocks")


@pytest.fixture(scope="module")
def modes(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp") / "fsdp.jsonl"
    # wrn-16-1: two blocks per group, so a unit per group (3) differs from one per block (6).
    result = torchrun("tutorial_utils.bench.workers.fsdp_step",
                      ["--model", "wrn-16-1", "--batch", "8", "--device", "cpu", "--out", str(out)],
                      nproc=2, timeout_s=180, metrics_file=out, echo=False)
    return {r["mode"]: r for r in result.metrics}


def state(record: dict) -> int:
    return record["params"] + record["grads"] + record["optimizer"]


def test_every_mode_trains_like_ddp(modes):
    assert list(modes) == list(fsdp_step.MODES)
    for mode in ("zero1", *SHARDED):
        # The same fp32 arithmetic; only how the two ranks' gradients are summed differs.
        assert modes[mode]["losses"] == pytest.approx(modes["ddp"]["losses"], rel=1e-5), mode


def test_sharded_modes_hold_half_the_state_per_rank(modes):
    ddp = modes["ddp"]
    for mode in SHARDED:
        assert state(modes[mode]) == pytest.approx(state(ddp) / 2, rel=0.02), mode
        for part in ("params", "grads", "optimizer"):
            assert modes[mode][part] == pytest.approx(ddp[part] / 2, rel=0.02), (mode, part)
    zero1 = modes["zero1"]  # the optimizer state only (split by whole tensors)
    assert (zero1["params"], zero1["grads"]) == (ddp["params"], ddp["grads"])
    assert zero1["optimizer"] == pytest.approx(ddp["optimizer"] / 2, rel=0.05)


def test_gpu_only_options_skip_clearly_on_cpu(tmp_path, capsys):
    out = tmp_path / "skip.jsonl"
    fsdp_step.main(["--model", "wrn-10-1", "--batch", "4", "--variants", "eager", "blocks",
                    "graph", "--device", "cpu", "--modes", "ddp", "zero3", "--out", str(out)])
    assert "skipped: --fit-gib and the variants blocks, model, graph need CUDA GPUs" in \
        capsys.readouterr().out
    records = [json.loads(line) for line in out.read_text().splitlines()]
    # a step graph is DDP's alone; the eager rows ran, in a process group of one
    assert [(r["mode"], r["variant"]) for r in records] == [
        ("ddp", "eager"), ("ddp", "blocks"), ("ddp", "graph"), ("zero3", "eager"),
        ("zero3", "blocks")]
    assert [r.get("skipped") for r in records] == [None, *["needs CUDA GPUs"] * 2, None,
                                                   "needs CUDA GPUs"]
    assert records[0]["losses"] == pytest.approx(records[3]["losses"], rel=1e-5)
    with pytest.raises(ConfigError, match="one mode and one variant per job"):  # a failed
        fsdp_step.FsdpStepConfig(fit_gib=3, modes=("ddp", "zero3"))  # attempt leaves memory


def test_one_process_forms_a_group_of_one_so_that_fsdp2_wraps_the_model():
    ctx = DistContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    with common.group_of_one(ctx):
        sharded = shard(wide_resnet("wrn-10-1"), ctx)
        assert all(isinstance(p, DTensor) for p in sharded.parameters())
    assert not torch.distributed.is_initialized()  # the group is gone again
    plain = shard(wide_resnet("wrn-10-1"), ctx)  # without a group: the model as it was
    assert not any(isinstance(p, DTensor) for p in plain.parameters())


def row(mode, variant, step_ms, host_ms, batch=128):
    return fsdp_step.FsdpRow(mode, variant, step_ms=step_ms, host_ms=host_ms,
                             per_gpu_batch=batch, world_size=1, losses=[2.0, 1.9], params=4e6,
                             grads=4e6, optimizer=4e6, images_per_s=batch / step_ms * 1e3,
                             model="wrn-10-1", device="cuda:0")


def test_the_sharding_table_marks_each_modes_best_and_the_host_bound_rows():
    rows = [row("ddp", "eager", 14.0, 13.5), row("ddp", "graph", 11.0, 0.2),
            row("zero3", "eager", 18.0, 17.9), row("zero3", "blocks", 16.0, 12.0),
            row("ddp", "eager", 50.0, 20.0, batch=512), row("zero3", "eager", 52.0, 30.0, 512)]
    text = sharding.time_table(rows, 128, "NVIDIA H200")
    lines = text.splitlines()[1:5]  # the note follows the rows
    marks = {tuple(line.split()[:2]): line.split("  ")[-1].strip() for line in lines}
    # each row's MFU: the model FLOPs of its step over its time, on one H200
    share = mfu.wrn_step_flops("wrn-10-1", 128) / 11e-3 / 989.5e12
    assert f" {share:.1%} " in lines[1] and "989.5 TFLOP/s" in text
    assert marks == {("ddp", "eager"): "host-bound", ("ddp", "graph"): "best",
                     ("zero3", "eager"): "host-bound", ("zero3", "blocks"): "best"}
    out = sharding.summary(rows, "NVIDIA H200")
    assert out["best_ddp_128_name"] == "graph" and out["best_fsdp_128_name"] == "zero3, blocks"
    assert out["best_ddp_128_mfu"] == pytest.approx(100 * share)
    assert out["fsdp_over_ddp_128"] == pytest.approx(16 / 11)
    assert out["fsdp_over_ddp_512"] == pytest.approx(52 / 50)
    assert out["host_ddp_512"] == pytest.approx(20 / 50)
    assert sharding.batches(rows) == [128, 512]
    assert out["compile_slower_128"] == "none"  # zero3's blocks beat its eager step


def test_the_modes_that_compiling_made_slower_and_how_many_were_host_bound():
    rows = [row("ddp", "eager", 14.0, 11.0), row("ddp", "blocks", 25.0, 28.0),
            row("ddp", "model", 21.0, 24.0), row("ddp", "graph", 11.0, 0.2),
            row("zero1", "eager", 24.0, 25.0), row("zero1", "model", 22.0, 26.0),
            row("zero3", "eager", 30.0, 28.0), row("zero3", "blocks", 57.0, 42.0),
            row("zero3", "model", 35.0, 40.0)]
    out = sharding.summary(rows)
    assert out["compile_slower_128"] == "ddp and zero3"  # zero1's model was faster than eager
    assert out["compile_slower_rows_128"] == 4 and out["compile_slower_host_bound_128"] == 3


def test_a_step_graph_is_measured_for_ddp_only():
    cfg = fsdp_step.FsdpStepConfig(modes=("ddp", "zero2"), variants=("eager", "graph"))
    assert cfg.runs() == [("ddp", "eager"), ("ddp", "graph"), ("zero2", "eager")]
    with pytest.raises(ConfigError, match="--nproc must be >= 1"):
        sharding.ShardingConfig(nproc=0)


def test_fsdp_units_of_a_wrn():
    net = wide_resnet("wrn-28-10")
    assert [len(u) for u in wrn_units(net, "group")] == [4, 4, 4]
    assert [len(u) for u in wrn_units(net, "block")] == [1] * 12
    assert wrn_units(net, "model") == []
    with pytest.raises(ValueError, match="units must be"):
        wrn_units(net, "layer")


# --- sharded checkpoints (torch.distributed.checkpoint) ---

DCP = "tutorial_utils.workers.dcp_resume"
DCP_ARGS = ["--model", "wrn-10-1", "--steps", "6", "--save-every", "2", "--device", "cpu"]


@pytest.fixture(scope="module")
def dcp_runs(tmp_path_factory):
    """Three jobs of six steps: straight on 2 processes; on 2 processes with rank 1 killed
    while saving step 4 and restarted by torchrun; resumed on 1 process from step 4."""
    root = tmp_path_factory.mktemp("dcp")
    runs = {}
    for name, nproc, extra, env, launcher in (
        ("straight", 2, ["--naive-save", str(root / "naive.pt")], {}, ("--standalone",)),
        ("killed", 2, ["--resume"], {KILL_ENV: "4", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
         ("--standalone", "--max-restarts=1")),
        ("one", 1, ["--resume"], {}, ("--standalone",)),
    ):
        if name == "one":  # the straight job's checkpoint of step 4, alone in its folder
            shutil.copytree(root / "straight" / "step-000004", root / name / "step-000004")
        metrics = root / f"{name}.jsonl"
        result = torchrun(DCP, [*DCP_ARGS, *extra, "--ckpt", str(root / name),
                                "--out", str(root / f"{name}.pt"), "--metrics", str(metrics)],
                          nproc=nproc, timeout_s=180, torchrun_args=launcher, env=env,
                          metrics_file=metrics, echo=False)
        runs[name] = (result, torch.load(root / f"{name}.pt", weights_only=True))
    runs["root"] = root
    return runs


def assert_same_training_state(a: dict, b: dict) -> None:
    """Parameters and momentum bitwise equal (BatchNorm's running statistics are per rank)."""
    params = [k for k in a["model"] if "running_" not in k and "num_batches" not in k]
    assert params and all(torch.equal(a["model"][k], b["model"][k]) for k in params)
    assert a["optim"]["state"].keys() == b["optim"]["state"].keys()
    for k, s in a["optim"]["state"].items():
        assert torch.equal(s["momentum_buffer"], b["optim"]["state"][k]["momentum_buffer"]), k


def test_saved_on_two_processes_resumed_on_one_gives_the_same_weights(dcp_runs):
    result, one = dcp_runs["one"]
    assert result.metrics[0]["resumed_from"] == "step-000004"
    assert result.metrics[0]["world_size"] == 1
    # Equal, not close: each slice of 4 images goes through the same kernels with the same
    # shapes on one CPU thread, and halving each loss (one process) is exact, so the two
    # half-gradients add up to the same bits as FSDP's average of two ranks.
    assert_same_training_state(dcp_runs["straight"][1], one)


def test_a_save_killed_before_its_commit_leaves_the_previous_checkpoint(dcp_runs):
    result, killed = dcp_runs["killed"]
    assert "rank 1: killed while saving step 4" in result.output
    (record,) = result.metrics  # only the restarted attempt finished
    assert record["resumed_from"] == "step-000002"  # the uncommitted step 4 was ignored
    assert_same_training_state(dcp_runs["straight"][1], killed)
    assert sorted(p.name for p in (dcp_runs["root"] / "killed").iterdir()) == [
        "step-000004", "step-000006"]  # the restart saved step 4 again; the last two kept


def test_rank0_torch_save_of_an_fsdp_model_holds_only_its_shards(dcp_runs):
    from torch.distributed.tensor import DTensor

    # weights_only=False: DTensor is not on the safe list, and this file is ours.
    naive = torch.load(dcp_runs["root"] / "naive.pt", weights_only=False)
    full = dcp_runs["straight"][1]["model"]
    params = [k for k in full if "running_" not in k and "num_batches" not in k]
    assert all(isinstance(naive[k], DTensor) for k in params)
    held = sum(naive[k].to_local().numel() for k in params)
    assert held == pytest.approx(sum(full[k].numel() for k in params) / 2, rel=0.02)


def test_loading_ignores_uncommitted_folders(tmp_path):
    ctx = DistContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    assert latest_checkpoint(tmp_path) is None
    (tmp_path / ".step-000002.tmp").mkdir()
    commit(tmp_path, tmp_path / ".step-000002.tmp", ctx)
    (tmp_path / ".step-000004.tmp").mkdir()  # a save killed half-way
    (tmp_path / ".step-000004.tmp" / "__0_0.distcp").write_bytes(b"partial")
    assert latest_checkpoint(tmp_path).name == "step-000002"
    assert commit(tmp_path, tmp_path / ".step-000004.tmp", ctx).name == "step-000004"
    assert latest_checkpoint(tmp_path).name == "step-000004"
    assert not (tmp_path / ".step-000004.tmp").exists()


# --- on two GPUs ---


@pytest.mark.multigpu
def test_fsdp_modes_on_gpus(tmp_path):
    out = tmp_path / "fsdp.jsonl"
    result = torchrun("tutorial_utils.bench.workers.fsdp_step",
                      ["--model", "wrn-16-4", "--batch", "64", "--device", "cuda", "--repeats", "5",
                       "--variants", "eager", "blocks", "--prefetch", "--out", str(out)],
                      nproc=2, timeout_s=600, metrics_file=out, echo=False)
    modes = {r["mode"]: r for r in result.metrics}
    for mode in SHARDED:
        assert state(modes[mode]) == pytest.approx(state(modes["ddp"]) / 2, rel=0.02)
        # bf16 autocast in both, so only close
        assert modes[mode]["losses"] == pytest.approx(modes["ddp"]["losses"], rel=1e-2)
        assert modes[mode]["step_ms"] > 0 and modes[mode]["peak_gib"] > 0


@pytest.mark.multigpu
def test_sharding_lets_a_model_train_that_ddp_cannot_under_a_memory_cap(tmp_path):
    # WRN-40-20 (223 M parameters) at 8 images per GPU, 3 GiB per process. On one H200 a
    # DDP step of it peaked at 4.1 GiB, and FSDP with a unit per block at 2.9 GiB before
    # sharding halves its 12 bytes per parameter of state.
    fits = {}
    for mode in ("ddp", "zero3-blocks"):
        out = tmp_path / f"{mode}.jsonl"
        (record,) = torchrun("tutorial_utils.bench.workers.fsdp_step",
                             ["--model", "wrn-40-20", "--batch", "8", "--fit-gib", "3",
                              "--modes", mode, "--device", "cuda", "--out", str(out)],
                             nproc=2, timeout_s=600, metrics_file=out, echo=False).metrics
        fits[mode] = record["fits"]
    assert fits == {"ddp": False, "zero3-blocks": True}


def test_zero3_reshards_after_forward_and_zero2_keeps_the_blocks_gathered(tmp_path):
    """What tells ZeRO-2 from ZeRO-3 apart: between forward and backward, ZeRO-3's units are
    back to their shards (half of each block per rank on 2), ZeRO-2's stay whole."""
    out = tmp_path / "gathered.jsonl"
    torchrun(str(Path(__file__).parent / "workers" / "fsdp_gathered.py"), [str(out)], nproc=2,
             timeout_s=120, echo=False)
    zero3, zero2 = read_jsonl(out)
    assert zero3["reshard_after_forward"] and not zero2["reshard_after_forward"]
    assert zero3["sharded"] == zero3["params"] > 0 and zero3["held"] == zero3["full"] // 2
    assert zero2["sharded"] == 0 and zero2["held"] == zero2["full"]
