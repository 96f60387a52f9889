import matplotlib
import pytest

matplotlib.use("Agg")

from tutorial_utils.bench_scaling import best_run, plot, run, table  # noqa: E402
from tutorial_utils.devices import gpu_count  # noqa: E402


def test_scaling_benchmark_measures_both_regimes_against_single_runs():
    runs = run("wrn-10-1", gpus=(2,), global_batch=8, per_gpu_batch=8, modes=("eager",), repeats=1)
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
    assert weak.predicted > 0
    assert "speed-up" in table(runs)
    assert best_run(runs, "single", "1 GPU", batch=8).step_ms == best8
    assert best_run(runs, "weak") is weak
    data_parallel = best_run(runs, "weak", "DataParallel")  # measured on GPUs only
    assert (data_parallel is None) == (gpu_count() < 2)
    fig = plot(runs, "tiny")
    assert len(fig.axes[0].patches) == sum(r.gpus > 1 for r in runs)  # a bar per multi-GPU run


def test_global_batch_must_split_evenly():
    with pytest.raises(ValueError, match="not divisible by 3 GPUs"):
        run("wrn-10-1", gpus=(2, 3), global_batch=128)


def test_bad_gpu_counts_are_one_line_errors(capsys, monkeypatch):
    from tutorial_utils import bench

    with pytest.raises(SystemExit) as err:
        bench.main(["--gpus", "3", "--global-batch", "128"])
    assert err.value.code == 2
    assert "global batch 128 is not divisible by 3 GPUs" in capsys.readouterr().err
    with pytest.raises(ValueError, match="2 or more GPUs"):
        run("wrn-10-1", gpus=(1,))
    monkeypatch.setattr(bench, "gpu_count", lambda: 2)
    monkeypatch.setattr("tutorial_utils.devices.gpu_count", lambda: 2)
    with pytest.raises(SystemExit):
        bench.main(["--gpus", "4"])
    assert "asked for 4 GPU(s) but this machine has 2" in capsys.readouterr().err


def test_single_gpu_reference_is_autotuned_like_the_ddp_workers(monkeypatch):
    import torch

    from tutorial_utils import bench_data_parallel
    from tutorial_utils.bench_one_gpu import LADDER, LadderSize

    seen = []
    monkeypatch.setattr(bench_data_parallel, "measure_rung",
                        lambda *a: seen.append(torch.backends.cudnn.benchmark))
    before = torch.backends.cudnn.benchmark
    bench_data_parallel.measure_single(LADDER[3], LadderSize("wrn-10-1", 2, 1, 1), "cpu")
    assert seen == [True] and torch.backends.cudnn.benchmark == before


def test_without_gpus_the_graph_modes_are_dropped_with_a_message(capsys, monkeypatch):
    from tutorial_utils import bench

    seen = {}

    def fake_run(*args, **kwargs):
        seen["modes"] = args[4]
        return []

    monkeypatch.setattr(bench, "gpu_count", lambda: 0)
    monkeypatch.setattr(bench, "run", fake_run)
    bench.main(["--model", "wrn-10-1"])
    assert seen["modes"] == ("eager",)
    assert "no GPU: the CUDA-graph runs are skipped" in capsys.readouterr().out


def test_copy_engine_runs_join_each_regime_on_gpus(monkeypatch):
    from tutorial_utils import bench

    flags_seen = []

    def fake_step_graph(model, batch, n, repeats, device, flags=()):
        flags_seen.append(tuple(flags))
        return {"ddp_ms": 4.0 * batch / 64}

    monkeypatch.setattr(bench, "require_gpus", lambda n: None)
    monkeypatch.setattr(bench, "single", lambda model, b, mode, r, d: bench.Run(
        "single", "1 GPU", mode, 1, b, 10.0 * b / 128))
    monkeypatch.setattr(bench, "ddp_run", lambda model, b, n, mode, r, regime, d: bench.Run(
        regime, "DDP", mode, n, b, 8.0 * b / 64))
    monkeypatch.setattr(bench, "time_step_graph", fake_step_graph)
    runs = run("wrn-10-1", gpus=(2,), modes=("step graph",), data_parallel=False, device="cuda")
    copy = {r.regime: r for r in runs if r.method == bench.COPY_ENGINE}
    assert flags_seen == [bench.COPY_ENGINE_FLAGS] * 2
    assert (copy["strong"].per_gpu_batch, copy["weak"].per_gpu_batch) == (64, 128)
    assert copy["strong"].speedup == pytest.approx(10.0 / 4.0)  # 128 images: 10 ms on one GPU
    assert copy["weak"].speedup == pytest.approx(2 * 10.0 / 8.0)
    assert best_run(runs, "strong", bench.COPY_ENGINE) is copy["strong"]
    without = run("wrn-10-1", gpus=(2,), modes=("step graph",), data_parallel=False,
                  device="cuda", copy_engine=False)
    assert all(r.method != bench.COPY_ENGINE for r in without)
