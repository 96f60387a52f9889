"""Chapter 5's training-run helpers, on two CPU processes."""

import matplotlib

matplotlib.use("Agg")

from tutorial_utils.experiment import plot_curves, table, train  # noqa: E402

TINY = ["--depth", "10", "--width", "1", "--batch", "64", "--data", "synthetic", "--device", "cpu",
        "--no-bf16", "--epochs", "2", "--checkpoint-every", "0"]


def test_training_runs_are_launched_read_back_and_compared(tmp_path):
    one = train(1, TINY, tmp_path / "one", label="1 process")
    two = train(2, TINY, tmp_path / "two", label="2 processes")
    assert [e["epoch"] for e in two.epochs] == [1, 2]
    assert (one.start["per_gpu_batch"], two.start["per_gpu_batch"]) == (64, 32)
    assert two.start["global_batch"] == 64 and two.start["synthetic_data"]
    assert two.train_s == sum(e["epoch_time_s"] for e in two.epochs)
    assert two.steady_epoch_s == two.epochs[1]["epoch_time_s"]
    rows = table([one, two], reference=one).splitlines()
    assert rows[1].startswith("1 process") and "1.00x" in rows[1]
    assert f"{one.train_s / two.train_s:.2f}x" in rows[2]
    fig = plot_curves([one, two], "tiny")
    assert len(fig.axes) == 2 and len(fig.axes[0].lines) == 2
