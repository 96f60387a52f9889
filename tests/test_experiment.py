"""Chapter 5's training-run helpers, on two CPU processes."""

import math

import matplotlib
import pytest

matplotlib.use("Agg")

from tutorial_utils.bench.experiment import (  # noqa: E402
    batchnorm_table,
    plan,
    plot_curves,
    runs_table,
    scaling_summary,
    shortest_schedule,
    targets_table,
    time_to_accuracy,
    train,
    with_batch,
)
from tutorial_utils.trainer import TrainConfig  # noqa: E402


def tiny(out, **kw):
    return TrainConfig(**{**dict(depth=10, width=1, batch=64, data="synthetic", device="cpu",
                                 limit_per_class=50, precision="fp32", epochs=2,
                                 checkpoint_every=0, out=out), **kw})


def test_training_runs_are_launched_read_back_and_compared(tmp_path):
    one = train(1, tiny(tmp_path / "one"), label="1 process")
    two = train(2, tiny(tmp_path / "two"), label="2 processes")
    assert [e["epoch"] for e in two.epochs] == [1, 2]
    assert (one.start["per_gpu_batch"], two.start["per_gpu_batch"]) == (64, 32)
    assert two.start["global_batch"] == 64 and two.start["synthetic_data"]
    assert two.train_s == pytest.approx(sum(e["epoch_time_s"] for e in two.epochs))
    assert two.steady_epoch_s == two.epochs[1]["epoch_time_s"]
    rows = runs_table([one, two], reference=one).splitlines()
    assert rows[1].startswith("1 process") and "1.00" in rows[1]
    assert f"{one.train_s / two.train_s:.2f}" in rows[2]
    summary = scaling_summary([one, two])
    assert summary["x_2"] == pytest.approx(one.train_s / two.train_s) and summary["n_max"] == 2
    assert math.isnan(scaling_summary([one])["x_max"])  # no multi-process run: no ratio
    fig = plot_curves([one, two], "tiny", targets=(0.5,))
    assert len(fig.axes) == 2 and len(fig.axes[0].lines) == 2


def run_of(accs, epoch_s=10.0, seed=0):
    from tutorial_utils.bench.experiment import TrainingRun

    epochs = [{"epoch": i + 1, "test_acc": a, "epoch_time_s": epoch_s,
               "train_time_s": epoch_s * (i + 1)} for i, a in enumerate(accs)]
    start = {"config": {"epochs": len(accs), "seed": seed}, "compile_warmup_s": 5.0}
    return TrainingRun(1, f"{len(accs)} epochs, seed {seed}", epochs, start)


def test_time_to_accuracy_within_a_run_and_across_schedules():
    short, long = run_of([0.5, 0.8, 0.905]), run_of([0.4, 0.7, 0.85, 0.89, 0.91, 0.92])
    assert time_to_accuracy(long, 0.90) == 50.0  # the first epoch at or past the target
    assert math.isnan(time_to_accuracy(short, 0.95))
    # the 3-epoch schedule reaches 90 % at its end in 30 s: shorter than the 6-epoch one
    assert shortest_schedule([short, long], 0.90) is short
    assert shortest_schedule([short, long], 0.915) is long
    assert shortest_schedule([short], 0.99) is None


def test_larger_batches_scale_the_learning_rate_by_rule(tmp_path):
    base = TrainConfig(batch=128, lr=0.1, out=tmp_path / "fast")
    linear, sqrt = with_batch(base, 512), with_batch(base, 512, "sqrt")
    assert linear.peak_lr(1) == pytest.approx(0.4)  # 0.1 x 512/128 (Goyal et al.)
    assert sqrt.peak_lr(1) == pytest.approx(0.2)  # 0.1 x sqrt(512/128)
    assert linear.out != sqrt.out != base.out


def test_plan_on_each_kind_of_machine():
    assert plan(0, "full").counts == [1, 2] and plan(0, "full").profile == "smoke"
    one = plan(1, "full")
    assert (one.device, one.counts, one.profile) == ("cuda", [1], "full")
    assert "two-GPU run" in one.note
    assert plan(4, "full").counts == [1, 2, 4]


def test_a_run_in_several_attempts_counts_every_compilation():
    from tutorial_utils.bench.experiment import TrainingRun

    records = [{"event": "start", "world_size": 1, "compile_warmup_s": 30.0, "start_epoch": 0},
               {"event": "epoch", "epoch": 1, "epoch_time_s": 4.0, "test_acc": 0.5},
               {"event": "start", "world_size": 1, "compile_warmup_s": 12.0, "start_epoch": 1},
               {"event": "epoch", "epoch": 2, "epoch_time_s": 4.0, "test_acc": 0.6}]
    run = TrainingRun.from_records(records, "two attempts")
    assert run.compile_s == 42.0 and [e["epoch"] for e in run.epochs] == [1, 2]
    assert run.final_acc == 0.6 and run.processes == 1
    with pytest.raises(ValueError, match="no start record"):
        TrainingRun.from_records(records[1:2], "headless")


def test_a_target_is_met_by_the_mean_of_the_seeds_and_the_lowest_is_shown():
    # 2 epochs: seeds end at 90.4 and 89.8 % (mean 90.1); 3 epochs: 91.2, 90.9, 91.1 (mean 91.07)
    short = [run_of([0.8, a], seed=s) for s, a in enumerate([0.904, 0.898])]
    long = [run_of([0.8, 0.9, a], seed=s) for s, a in enumerate([0.912, 0.909, 0.911])]
    text, summary = targets_table(short + long, (0.90, 0.91, 0.92))
    assert summary["tta_900_epochs"] == 2 and summary["tta_900_s"] == 20.0
    assert summary["tta_900_every"] == "not seed 1"  # the mean met it; seed 1 did not
    assert summary["tta_900_lowest"] == pytest.approx(89.8)
    assert summary["tta_910_epochs"] == 3 and summary["tta_910_acc"] == pytest.approx(91.0667)
    assert summary["tta_910_every"] == "not seed 1" and summary["tta_910_compile_s"] == 5.0
    assert summary["tta_920_status"] == "not reached by any schedule tried"
    assert summary["tta_910_status"] == "the 3-epoch schedule, 30.0 s of training (mean of 3 seeds)"
    assert summary["tta_900_status"] == "the 2-epoch schedule, 20.0 s of training (mean of 2 seeds)"
    assert "every seed" in text.splitlines()[0]


def test_batchnorm_groups_are_compared_with_the_whole_batch_by_mean_and_lowest_seed():
    def bn_run(group, acc, seed):
        run = run_of([0.5, acc], seed=seed)
        run.start |= {"per_gpu_batch": 128, "config": run.start["config"] | {"ghost_bn": group}}
        return run

    runs = [bn_run(None, 0.90, 0), bn_run(None, 0.92, 1), bn_run(4, 0.86, 0),
            bn_run(4, 0.88, 1), bn_run(32, 0.91, 0)]
    text, summary = batchnorm_table(runs)
    assert summary["bn_whole"] == 128 and summary["bn_whole_acc"] == pytest.approx(91.0)
    assert summary["bn_smallest"] == 4 and summary["bn_smallest_gpus"] == 32
    assert summary["bn_4_acc"] == pytest.approx(87.0) and summary["bn_4_lowest"] == 86.0
    assert summary["bn_smallest_drop"] == pytest.approx(4.0)
    assert summary["bn_seeds"] == 1  # the fewest seeds any group has
    head, *lines = text.splitlines()
    assert "as on GPUs" in head and [int(line.split()[0]) for line in lines] == [128, 32, 4]
    with pytest.raises(ValueError, match="no run normalises over the whole 128 images"):
        batchnorm_table(runs[2:])  # a table of groups alone compares with nothing
    accumulated = [bn_run(None, 0.9, 0), bn_run(8, 0.89, 0)]
    for r in accumulated:  # 4 micro-batches of 32: BatchNorm sees 32 images at once
        r.start["config"] = r.start["config"] | {"grad_accum": 4}
    _, summary = batchnorm_table(accumulated)
    assert summary["bn_whole"] == 32 and summary["bn_8_drop"] == pytest.approx(1.0)
