import matplotlib
import pytest

matplotlib.use("Agg")

from tutorial_utils.bench import scaling as bench  # noqa: E402
from tutorial_utils.bench.scaling import ScalingConfig, best_run, plot, run, table_of  # noqa: E402
from tutorial_utils.config import ConfigError  # noqa: E402
from tutorial_utils.devices import gpu_count  # noqa: E402

# Two "GPUs" are CPU processes unless the machine has two GPUs: one GPU is not enough.
DEVICE = "cuda" if gpu_count() >= 2 else "cpu"


def test_scaling_benchmark_measures_both_regimes_against_single_runs():
    runs = run(ScalingConfig(model="wrn-10-1", gpus=(2,), global_batch=8, per_gpu_batch=8,
                             modes=("eager",), warmup=1, repeats=1, device=DEVICE))
    singles = [r for r in runs if r.regime == "single"]
    assert sorted(r.per_gpu_batch for r in singles) == [4, 8]
    strong = next(r for r in runs if r.regime == "strong" and r.method == "DDP")
    weak = next(r for r in runs if r.regime == "weak" and r.method == "DDP")
    assert (strong.per_gpu_batch, weak.per_gpu_batch) == (4, 8)
    best8 = min(r.step_ms for r in singles if r.per_gpu_batch == 8)
    # Both regimes are compared with the best single run at the global (strong) or per-GPU
    # (weak) batch: 8 images per step on one device.
    assert strong.speedup == pytest.approx(best8 / strong.step_ms)
    assert weak.speedup == pytest.approx(2 * best8 / weak.step_ms)
    # the prediction (compute alone plus a ring all-reduce, no overlap) is a speed-up against
    # the same reference
    assert weak.predicted == pytest.approx(2 * best8 / weak.predicted_ms)
    assert weak.predicted_ms > 0 and strong.predicted == pytest.approx(best8 / strong.predicted_ms)
    assert "speed-up" in table_of(runs)
    assert best_run(runs, "single", "1 GPU", batch=8).step_ms == best8
    assert best_run(runs, "weak") is weak
    data_parallel = best_run(runs, "weak", "DataParallel")  # measured on GPUs only
    assert (data_parallel is None) == (DEVICE == "cpu")
    fig = plot(runs, "tiny")
    assert len(fig.axes[0].patches) == sum(r.gpus > 1 for r in runs)  # a bar per multi-GPU run


@pytest.mark.parametrize("kwargs, message", [
    ({"gpus": (2, 3)}, "not divisible by 3 GPUs"), ({"gpus": (1,)}, "2 or more GPUs"),
    ({"gpus": ()}, "2 or more GPUs"), ({"repeats": 0}, "--repeats"), ({"model": "vgg"}, "--model"),
    ({"modes": ()}, "at least one mode"), ({"per_gpu_batch": 0}, "batches must be >= 1")])
def test_bad_settings_are_config_errors_before_any_gpu_is_counted(kwargs, message, monkeypatch):
    # on a one-GPU machine the bad setting, not the GPU count, must be what is reported
    monkeypatch.setattr(bench, "require_gpus", lambda n: pytest.fail("GPUs checked first"))
    with pytest.raises(ConfigError, match=message):
        ScalingConfig(**kwargs)


def test_bad_gpu_counts_are_one_line_errors(capsys, monkeypatch):
    with pytest.raises(SystemExit) as err:
        bench.main(["--gpus", "3", "--global-batch", "128"])
    assert err.value.code == 2
    assert "--global-batch 128 is not divisible by 3 GPUs" in capsys.readouterr().err
    monkeypatch.setattr(bench, "gpu_count", lambda: 2)
    monkeypatch.setattr("tutorial_utils.devices.gpu_count", lambda: 2)
    with pytest.raises(SystemExit) as err:
        bench.main(["--gpus", "4"])
    assert err.value.code == 2
    assert "asked for 4 GPU(s) but this machine has 2" in capsys.readouterr().err


def test_single_gpu_reference_is_autotuned_like_the_ddp_workers(monkeypatch):
    import torch

    from tutorial_utils.bench import workload
    from tutorial_utils.bench.workload import LADDER, Workload

    seen = []
    monkeypatch.setattr(workload, "make_train_step",
                        lambda *a: seen.append(torch.backends.cudnn.benchmark) or (lambda: None))
    before = torch.backends.cudnn.benchmark
    workload.measure_rung(LADDER[3], Workload("wrn-10-1", 2, 1, 1), torch.device("cpu"))
    assert seen == [True] and torch.backends.cudnn.benchmark == before


def test_without_gpus_the_graph_modes_are_left_out_with_a_message(capsys, monkeypatch):
    seen = []
    monkeypatch.setattr(bench, "gpu_count", lambda: 0)
    monkeypatch.setattr(bench, "single", lambda cfg, b, mode, d: seen.append(mode) or bench.Run(
        "single", "1 GPU", mode, 1, b, 1.0))
    monkeypatch.setattr(bench, "ddp_run", lambda cfg, b, n, mode, regime, d: bench.Run(
        regime, "DDP", mode, n, b, 1.0))
    bench.main(["--model", "wrn-10-1"])
    assert set(seen) == {"eager"}
    assert "no GPU: the CUDA-graph runs are left out" in capsys.readouterr().out


def test_summary_names_every_regime_and_mode(monkeypatch):
    monkeypatch.setattr(bench, "require_gpus", lambda n: None)
    monkeypatch.setattr(bench, "single", lambda cfg, b, mode, d: bench.Run(
        "single", "1 GPU", mode, 1, b, 10.0 * b / 128))
    monkeypatch.setattr(bench, "ddp_run", lambda cfg, b, n, mode, regime, d: bench.Run(
        regime, "DDP", mode, n, b, 8.0 * b / 64, predicted_ms=7.0 * b / 64))
    runs = run(ScalingConfig(model="wrn-10-1", gpus=(2,), modes=("eager", "step graph"),
                             data_parallel=False, device="cuda"))
    out = bench.summary(runs, 128)
    assert out["eager_ref_ms"] == pytest.approx(10.0) and out["batch_half"] == 64
    assert out["weak_2_x"] == pytest.approx(2 * 10.0 / 16.0)  # 256 images in 16 ms vs 128 in 10
    assert out["strong_2_whole_x"] == pytest.approx(10.0 / 8.0)
    assert out["bench_n_max"] == 2 and out["strong_max_per_gpu"] == 64
