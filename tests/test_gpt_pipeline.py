"""Chapter 8: the GPT in pipeline stages under four schedules, equal to one process (gloo).

Tolerances: the pipeline sums each stage's micro-batch gradients and divides by their number,
where one process takes the mean over the whole batch at once: the same values in another
order of float32 sums. Losses agree to 1e-5 (about 2e-7 relative to ln 256) and gradients to
1e-6 (their largest is about 0.2); measured here: 5e-7 and 3e-8.
"""

import os
import subprocess
import sys

import pytest
import torch

from tutorial_utils.config import ConfigError
from tutorial_utils.launch import torchrun
from tutorial_utils.models.gpt import GPTConfig
from tutorial_utils.parallel import gpt_pipeline as gp
from tutorial_utils.workers.gpt_pipeline import measured_bubble

SMALL = GPTConfig(seq=16, layers=4, heads=2, dim=32)
SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zbv"]


def test_each_stage_holds_its_units_with_the_reference_weights():
    cpu = torch.device("cpu")
    whole = dict(gp.reference_gpt(SMALL, cpu).named_parameters())
    for n_stages in (1, 2, 4):
        held = 0
        for s in range(n_stages):
            module = gp.build_stage_module(SMALL, s, n_stages, cpu)
            names = gp.stage_parameter_names(SMALL, s, n_stages)
            assert (module.embed is not None) == (s == 0)
            assert (module.head is not None) == (s == n_stages - 1)
            for name, p in zip(names, module.parameters(), strict=True):
                torch.testing.assert_close(p, whole[name], rtol=0, atol=0)
                held += p.numel()
        assert held == sum(p.numel() for p in whole.values())
    # the GPT's own initialisation rule: residual projections scaled down with depth
    assert abs(whole["blocks.0.attn.o.weight"].std() - 0.02 / 8**0.5) < 2e-3
    assert torch.all(whole["blocks.1.attn.q.bias"] == 0)


def test_stages_are_dealt_in_a_loop_or_a_v():
    assert gp.block_bounds(5, 2) == [(0, 3), (3, 5)]
    assert gp.stage_indices("1f1b", 1, 4) == [1]
    assert gp.stage_indices("interleaved-1f1b", 1, 4) == [1, 5]
    assert gp.stage_indices("zbv", 1, 4) == [1, 6]  # down the V and back up


def test_bubble_predictions():
    assert gp.bubble_fraction("gpipe", 4, 4) == pytest.approx(3 / 7)
    assert gp.bubble_fraction("1f1b", 4, 4) == pytest.approx(3 / 7)
    assert gp.bubble_fraction("interleaved-1f1b", 4, 4) == pytest.approx(3 / 11)
    assert gp.bubble_fraction("zbv", 4, 4) == 0
    assert gp.bubble_fraction("1f1b", 2, 16) == pytest.approx(1 / 17)


def test_in_flight_predictions():
    def rows(schedule, p, m):
        return [gp.in_flight(schedule, r, p, m) for r in range(p)]

    assert rows("gpipe", 4, 8) == [8] * 4
    assert rows("1f1b", 4, 8) == [4, 3, 2, 1]
    assert rows("interleaved-1f1b", 4, 8) == [5.5, 4.5, 3.5, 2.5]
    assert rows("interleaved-1f1b", 4, 4) == [4, 4, 3.5, 2.5]
    assert rows("zbv", 4, 4) == [2.5, 3, 3.5, 4]
    assert rows("zbv", 4, 8) == [4] * 4  # p micro-batches on every process, like 1F1B's first


def test_the_measured_bubble_is_what_the_step_adds_to_the_slowest_stages_work():
    p, m, work = 4, 8, 3.0  # a GPipe step of (m + p - 1) micro-batch times
    assert measured_bubble((m + p - 1) * work, [work, 1.0, 2.0, work], m) == pytest.approx(
        gp.bubble_fraction("gpipe", p, m))


@pytest.mark.parametrize(("layers", "ranks", "schedule", "m", "message"), [
    (3, 4, "1f1b", 4, "1f1b on 4 processes has 4 stages, more than the GPT's 3 blocks"),
    (4, 4, "interleaved-1f1b", 4, "8 stages, more than the GPT's 4 blocks"),
    (4, 2, "1f1b", 1, "needs at least 2 micro-batches"),
    (4, 2, "pipedream", 4, "schedule must be one of"),
    (8, 4, "interleaved-1f1b", 9, "9 micro-batches in 2 rounds"),
])
def test_nonsense_pipelines_end_in_one_line(layers, ranks, schedule, m, message):
    cfg = GPTConfig(seq=16, layers=layers, heads=2, dim=32)
    with pytest.raises(ConfigError, match=message):
        gp.check_pipeline(cfg, ranks, schedule, m)


def test_the_worker_refuses_before_any_work():
    done = subprocess.run([sys.executable, "-m", "tutorial_utils.workers.gpt_pipeline",
                           "--layers", "4"], env={**os.environ, "WORLD_SIZE": "4"},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "python -m tutorial_utils.workers.gpt_pipeline: error: interleaved-1f1b on 4 processes "
        "has 8 stages, more than the GPT's 4 blocks: every stage needs a block"]


@pytest.mark.parametrize("ranks", [2, 4])
def test_every_schedule_equals_one_process(tmp_path, ranks):
    out = tmp_path / "rows.jsonl"
    # 2 processes also time two steps: the timing path runs, its numbers are not checked
    result = torchrun("tutorial_utils.workers.gpt_pipeline",
                      ["--check", "--micro-batches", "4", "--out", str(out), "--device", "cpu",
                       *(["--repeats", "2"] if ranks == 2 else [])],
                      nproc=ranks, timeout_s=240, metrics_file=out, echo=False)
    rows = {r["schedule"]: r for r in result.metrics}
    assert sorted(rows) == sorted(SCHEDULES)
    n_params = sum(p.numel() for p in gp.reference_gpt(
        GPTConfig(seq=16, layers=8, heads=2, dim=32), torch.device("meta")).parameters())
    for name, r in rows.items():
        assert r["ranks"] == ranks and r["stages"] == ranks * gp.stages_per_rank(name)
        assert r["loss_diff"] < 1e-5 and r["grad_diff"] < 1e-6, r
        assert sum(r["params_per_rank"]) == n_params and min(r["params_per_rank"]) > 0
        # what each process held at its peak: as predicted, and as torch's own plan says
        assert r["in_flight"] == r["in_flight_predicted"], r
        if r["in_flight_plan"] is not None:
            assert r["in_flight_plan"] == r["in_flight"]
        assert r["bubble_predicted"] == gp.bubble_fraction(name, ranks, 4)
        if ranks == 2:
            assert r["step_ms"] > 0 and min(r["work_ms"]) > 0 and r["bubble_measured"] < 1
    # the bytes held grow with the micro-batches in flight: the same per micro-batch on a
    # process whatever the schedule (GPipe holds 4 on each, 1F1B p - r)
    for a, b, n, k in zip(rows["gpipe"]["activation_mb"], rows["1f1b"]["activation_mb"],
                          rows["gpipe"]["in_flight"], rows["1f1b"]["in_flight"], strict=True):
        assert a / n == pytest.approx(b / k, rel=0.02)


def test_the_benchmark_makes_records_on_gpus_only_and_draws_its_rows():
    import matplotlib

    matplotlib.use("Agg")
    from tutorial_utils.bench import pipeline_schedules as bench

    with pytest.raises(ConfigError, match="--record measures GPUs"):
        bench.PipelineSchedulesConfig(record=True, device="cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="asked for 4 GPU"):
            bench.PipelineSchedulesConfig(record=True).check_machine()
    with pytest.raises(ConfigError, match="more than the GPT's 4 blocks"):
        bench.PipelineSchedulesConfig(layers=4)  # interleaved on 4 processes: 8 stages
    rows = [bench.ScheduleRow(s, p, p, m, 10.0 * m, 1.0, 0.1, gp.bubble_fraction(s, p, m), 1.0,
                              1.0, 1.0) for s in ("gpipe", "1f1b") for p in (2, 4) for m in (4, 8)]
    assert "gpipe" in bench.rows_table(rows)
    assert len(bench.bubble_figure(rows, "test").axes) == 2
