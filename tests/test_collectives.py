"""Chapter 3b: the hand-written collectives, bus bandwidth, the alpha-beta model, the benchmark."""

from pathlib import Path

import numpy as np
import pytest

from tutorial_utils.bench import collectives as bench
from tutorial_utils.config import ConfigError
from tutorial_utils.jsonl import read_jsonl
from tutorial_utils.launch import torchrun
from tutorial_utils.parallel.collectives import (
    AlphaBeta,
    algbw_gbps,
    bus_factor,
    busbw_gbps,
    fit_alpha_beta,
)
from tutorial_utils.solutions.ch03b import bucket_for_efficiency, busiest_rank_bytes, rescale_ring

WORKERS = Path(__file__).parent / "workers"
SIZES = [4096, 65536]  # bytes: two sizes, so every collective gets a fit


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda n: f"{n} ranks")
def hand_written(request, tmp_path_factory):
    """Gloo runs of the hand-written all-reduces against dist.all_reduce: on 2 ranks a ring
    has one neighbour each way, so only 3 and 4 tell a ring that walks the wrong way."""
    out = tmp_path_factory.mktemp("check") / "check.jsonl"
    torchrun(str(WORKERS / "collectives_check.py"), [str(out)], nproc=request.param,
             timeout_s=120, echo=False)
    return request.param, read_jsonl(out)


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """One 2-process gloo run of the benchmark worker at two small sizes."""
    cfg = bench.CollectivesConfig(nproc=2, device="cpu", max_mb=SIZES[-1] / 2**20, factor=16,
                                  gradients_of="wrn-10-1", warmup=1, repeats=2)
    return bench.run(cfg, timeout_s=120)


@pytest.mark.parametrize("algorithm", ["ring_all_reduce", "root_all_reduce"])
def test_hand_written_all_reduce_equals_dist_all_reduce(hand_written, algorithm):
    world, records = hand_written
    rows = [r for r in records if r["algorithm"] == algorithm]
    assert {r["numel"] for r in rows} == {world, 1001, 4096}  # 1001: 2 and 4 do not divide it
    assert {r["dtype"] for r in rows} == {"torch.float32", "torch.int64"}
    assert all(r["max_diff"] == 0 for r in rows if r["dtype"] == "torch.int64"), rows
    # floats: a + b is exact in any order, three or more terms round by the order of the sum
    tolerance = 0 if world == 2 else 1e-3  # the values are ~100: float32 rounds at ~1e-5
    assert all(r["max_diff"] <= tolerance for r in rows), rows


def test_worker_writes_every_collective_and_size(records):
    swept = {(r.collective, r.nbytes) for r in records if r.role == "sweep"}
    assert swept == {(c, n) for c in bench.COLLECTIVES for n in SIZES} | {
        (bench.RING, n) for n in SIZES}  # every fourth size and the largest
    for r in records:
        assert r.world_size == 2 and r.backend == "gloo"
        if r.role in ("sweep", "check"):
            assert r.time_s > 0 and r.busbw_gbps > 0
    (equal,) = [r for r in records if r.role == "equal"]
    assert equal.max_diff == 0
    (check,) = [r for r in records if r.role == "check"]
    assert check.collective == "all_reduce"
    assert check.nbytes == bench.gradient_bytes("wrn-10-1")


@pytest.mark.parametrize("kwargs, message", [
    ({"nproc": 1}, "collectives need several processes"), ({"max_mb": -5}, "--max-mb"),
    ({"factor": 1}, "--factor"), ({"repeats": 0}, "--repeats"),
    ({"gradients_of": "resnet50"}, "--gradients-of")])
def test_bad_settings_are_one_line_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        bench.CollectivesConfig(**kwargs)


def synthetic_records(alpha=10e-6, beta=100e9, sizes=(4096, 2**20, 2**26), check=2**25):
    from tutorial_utils.bench.workers.collectives import CollectiveRow

    """What the worker writes, for times that follow t = alpha + n / beta exactly."""
    common = {"world_size": 2, "backend": "nccl", "device": "cuda"}
    rows = [{**common, "collective": bench.RING, "role": "equal", "max_diff": 0.0}]
    for name in (*bench.COLLECTIVES, bench.RING):
        for n in sizes:
            t = alpha + n / beta
            rows.append(common | {"collective": name, "role": "sweep", "nbytes": n, "time_s": t,
                                  "q25_s": t * 0.99, "q75_s": t * 1.01,
                                  "busbw_gbps": busbw_gbps(name, n, t, 2)})
    t = alpha + check / beta * 1.05  # measured 5 % slower than the model
    rows += [common | {"collective": "all_reduce", "role": "check", "nbytes": check,
                       "time_s": t, "busbw_gbps": busbw_gbps("all_reduce", check, t, 2)}]
    return [CollectiveRow(**r) for r in rows]


def test_benchmark_fit_table_plot_and_summary():
    records = synthetic_records()
    fits = bench.fit(records)
    assert set(fits) == {*bench.COLLECTIVES, bench.RING}
    assert fits["all_reduce"].alpha_s == pytest.approx(10e-6)
    assert fits["all_reduce"].beta == pytest.approx(100e9)
    text = bench.table(records)
    assert "reduce-scatter" in text and "64 MiB" in text
    assert "n_1/2" in bench.fit_table(records, fits)
    s = bench.summary(records, fits)
    assert s["nproc"] == 2 and s["n_sizes"] == 3 and s["max_size"] == "64 MiB"
    assert s["all_reduce_alpha_us"] == pytest.approx(10) and s["all_reduce_err_pct"] < 1e-6
    model_s, measured_s = 10e-6 + 2**25 / 100e9, 10e-6 + 2**25 / 100e9 * 1.05
    assert s["grad_pred_over_meas"] == pytest.approx(model_s / measured_s)
    assert s["grad_verdict"] == "within" and s["grad_where"] == "inside"
    assert s["ring_over_builtin"] == pytest.approx(1) and s["rs_ag_over_ar"] == pytest.approx(2)
    assert all(isinstance(v, int | float | str) for v in s.values())
    bench.plot(records, fits, "test")


def test_bus_bandwidth_factors_follow_nccl_tests():
    assert bus_factor("all_reduce", 2) == 1.0
    assert bus_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    assert bus_factor("reduce_scatter", 4) == bus_factor("all_gather", 4) == 0.75
    assert bus_factor("broadcast", 8) == 1.0
    assert busbw_gbps("all_reduce", 1e9, 0.01, 4) == pytest.approx(algbw_gbps(1e9, 0.01) * 1.5)
    with pytest.raises(ValueError, match="unknown collective"):
        bus_factor("alltoall", 2)


def test_alpha_beta_fit_recovers_known_alpha_and_beta():
    sizes = np.geomspace(4096, 256 * 2**20, 17)
    alpha, beta = 12e-6, 300e9
    exact = fit_alpha_beta(sizes, alpha + sizes / beta)
    assert exact.alpha_s == pytest.approx(alpha, rel=1e-6)
    assert exact.beta == pytest.approx(beta, rel=1e-6)
    noisy = alpha + sizes / beta * (1 + np.random.default_rng(0).normal(0, 0.01, sizes.size))
    assert fit_alpha_beta(sizes, noisy).beta == pytest.approx(beta, rel=0.02)
    assert exact.predict_s(1e9) == pytest.approx(alpha + 1e9 / beta)
    assert exact.half_bytes == pytest.approx(alpha * beta)


def test_alpha_beta_fit_never_returns_a_negative_latency():
    sizes = np.array([1e3, 1e6, 1e8])
    model = fit_alpha_beta(sizes, sizes / 1e9 - 1e-7)  # the line's intercept is below zero
    assert model.alpha_s == 0 and model.beta == pytest.approx(1e9, rel=0.1)
    with pytest.raises(ValueError):
        fit_alpha_beta([1e3], [1e-5])


def test_the_fit_weighs_relative_errors_so_the_small_messages_set_alpha():
    # large messages that bend away from the line (as memory-bound CPU processes do) would
    # pull an absolute least-squares line's intercept below zero; alpha comes from the small
    sizes = np.geomspace(4096, 16 * 2**20, 13)
    times = 30e-6 + sizes / 2e9 * np.where(sizes > 2**22, 1.6, 1.0)
    model = fit_alpha_beta(sizes, times)
    assert model.alpha_s == pytest.approx(30e-6, rel=0.25)
    worst = max(abs(model.predict_s(n) / t - 1) for n, t in zip(sizes, times, strict=True))
    assert worst < 0.5


def test_exercise_solutions():
    # 1: the ring's busiest rank moves 2(N-1)/N of the buffer, the root (N-1) times all of it.
    assert busiest_rank_bytes("ring", 100, 4) == 150
    assert busiest_rank_bytes("root", 100, 4) == 300
    # 2: b / (alpha + b / beta) = 0.9 beta needs b = 9 alpha beta.
    model = AlphaBeta(alpha_s=10e-6, beta=100e9)
    b = bucket_for_efficiency(model, 0.9)
    assert b == pytest.approx(9e6)
    assert b / model.predict_s(b) == pytest.approx(0.9 * model.beta)
    # 3: 2 -> 8 ranks: 7x the steps' latency; bus bandwidth kept, so algbw * 1 = new * 7/4.
    eight = rescale_ring(model, 2, 8)
    assert eight.alpha_s == pytest.approx(7 * model.alpha_s)
    assert eight.beta * bus_factor("all_reduce", 8) == pytest.approx(model.beta)
    assert rescale_ring(model, 2, 2) == model


def test_message_sizes_and_gradient_bytes():
    assert bench.message_sizes(16 * 2**20) == [4096 * 4**k for k in range(7)]
    assert bench.message_sizes(8192, factor=2) == [4096, 8192]
    assert bench.gradient_bytes("wrn-28-10") == 4 * 36_479_194  # every parameter, float32
    assert bench.human_bytes(4096) == "4 KiB" and bench.human_bytes(1.5 * 2**20) == "1.5 MiB"


def test_auto_with_fewer_gpus_than_processes_runs_cpu_processes(monkeypatch):
    from tutorial_utils import devices

    monkeypatch.setattr(devices, "gpu_count", lambda: 1)
    monkeypatch.setattr(bench, "gpu_count", lambda: 1)
    cfg = bench.CollectivesConfig(nproc=2)
    cfg.check_machine()  # no error: gloo between CPU processes instead
    assert cfg.on == "cpu"
    with pytest.raises(ConfigError, match="--nproc 2: asked for 2 GPU"):
        bench.CollectivesConfig(nproc=2, device="cuda").check_machine()
    with pytest.raises(ConfigError, match="leave out --record"):
        bench.CollectivesConfig(nproc=2, record=True).check_machine()
