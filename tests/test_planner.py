"""Chapter 8's planner: its memory model against what a GPT holds, its step-time arithmetic on
hand-computed cases, the layout it picks, and the layouts it refuses in one line."""

import math

import pytest
import torch

from tutorial_utils.config import ConfigError
from tutorial_utils.memory import saved_tensors, storage_bytes
from tutorial_utils.models.gpt import GPT, GPTConfig, flops_per_token, lm_loss
from tutorial_utils.parallel import planner as P
from tutorial_utils.parallel.collectives import AlphaBeta

SMALL = GPTConfig(seq=16, layers=2, heads=2, dim=32)


def test_parameters_gradients_and_adam_state_are_predicted_exactly():
    torch.manual_seed(0)
    model = GPT(SMALL)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    x = torch.randint(0, 256, (2, 16))
    lm_loss(model(x), x).backward()
    opt.step()
    params = list(model.parameters())
    moments = [v for s in opt.state.values() for k, v in s.items() if k != "step"]
    shape = P.ModelShape.of(SMALL, batch=2)
    assert shape.params == sum(p.numel() for p in params)
    mem = P.memory(shape, P.Layout(zero="replicated"), P.Recipe("adam", "fp32"))
    assert mem.parameters == storage_bytes(params)
    assert mem.gradients == storage_bytes(p.grad for p in params)
    assert mem.optimizer == storage_bytes(moments)  # AdamW's step counters are left out


def test_activations_are_what_autograd_keeps():
    model = GPT(SMALL)
    x = torch.randint(0, 256, (2, 16))
    with saved_tensors(exclude=list(model.parameters())) as saved:
        lm_loss(model(x), x)
    measured = sum(saved["activations"].values())
    predicted = P.memory(P.ModelShape.of(SMALL, batch=2), P.Layout(),
                         P.Recipe("adam", "fp32")).activations
    # left out: the positions' indices and the loss's own scalars, 4 bytes a token here
    assert predicted == pytest.approx(measured, rel=0.002)


def test_params_per_gpu_split_by_tp_and_stage():
    shape = P.ModelShape(layers=4, dim=64, heads=4, seq=32, batch=8)
    whole = shape.params
    layout = P.Layout(tp=2, pp=2, micro_batch=2)
    split = [P.params_per_gpu(shape, layout, s) for s in (0, 1)]
    d = 64
    # what tp leaves whole on both ranks: the embeddings, the norms, o's and proj's biases
    whole_on_both = (256 + 32) * d + 4 * (4 * d + 2 * d) + 2 * d
    assert 2 * sum(split) - whole_on_both == whole


def hand_hardware():
    return P.Hardware("hand", memory_bytes=1e12, peak_flops=1e12, efficiency=0.5,
                      link=P.Link(alpha_s=1e-5, bus_bytes_per_s=1e10))


def test_step_time_of_data_parallel_by_hand():
    shape = P.ModelShape(layers=4, dim=64, heads=4, seq=32, batch=8)
    hw = hand_hardware()
    t = P.step_time(shape, P.Layout(dp=4, zero="replicated"), hw, P.Recipe("adam", "fp32"))
    n = shape.params
    flops = (6 * n + 12 * 4 * 32 * 64) * 8 * 32
    assert flops == flops_per_token(shape.gpt, n) * 8 * 32
    assert t.compute == pytest.approx(flops / 4 / (1e12 * 0.5))
    # the gradients (4 bytes each) all-reduced over 4: 2(N-1)/N of them on the bus
    assert t.dp == pytest.approx(1e-5 + 1.5 * 4 * n / 1e10)
    assert t.tp == t.pp == t.cp == t.bubble == 0
    assert t.total == pytest.approx(t.compute + t.dp)


def test_step_time_of_tensor_pipeline_and_context_by_hand():
    shape = P.ModelShape(layers=4, dim=64, heads=4, seq=32, batch=8)
    hw, vb = hand_hardware(), 2  # mixed precision: 2 bytes an activation
    layout = P.Layout(dp=1, tp=2, pp=2, cp=2, micro_batch=2, schedule="1f1b")
    t = P.step_time(shape, layout, hw)
    m, tokens = 4, 2 * 32 / 2  # 8 sequences in micro-batches of 2; a micro-batch's tokens / cp
    compute = shape.flops_per_step / 8 / (1e12 * 0.5)
    assert t.compute == pytest.approx(compute)
    assert t.bubble == pytest.approx(compute * (1 / (m + 1)) / (1 - 1 / (m + 1)))  # (p-1)/(m+p-1)
    # tp: 4 all-reduces per block (2 blocks a stage) and micro-batch, 2(N-1)/N = 1 on two ranks
    assert t.tp == pytest.approx(4 * 2 * m * (1e-5 + tokens * 64 * vb / 1e10))
    # pp: an activation and a gradient per micro-batch, point to point
    assert t.pp == pytest.approx(2 * m * (1e-5 + tokens * 64 * vb / 1e10))
    # cp: 6 ring passes of this rank's keys or values (its tp half) per block and micro-batch
    assert t.cp == pytest.approx(6 * 1 * 2 * m * (1e-5 + tokens * 32 * vb / 1e10))
    # dp over cp: ZeRO-3's two all-gathers and a reduce-scatter, one per block and one more
    n = max(P.params_per_gpu(shape, layout, s) for s in (0, 1))
    assert t.dp == pytest.approx(3 * (2 * 1e-5 + 1e-5 + 0.5 * n * vb / 1e10))


def test_a_group_wider_than_a_node_takes_the_slower_link():
    shape = P.ModelShape(layers=4, dim=64, heads=4, seq=32, batch=16)
    slow = P.Link(1e-4, 1e9)
    hw = P.Hardware("two nodes", 1e12, 1e12, P.Link(1e-5, 1e10), gpus_per_node=4,
                    inter_node=slow)
    t = P.step_time(shape, P.Layout(dp=2, tp=4, zero="replicated"), hw)
    assert t.dp == pytest.approx(slow.seconds("all_reduce", 2 * P.params_per_gpu(
        shape, P.Layout(dp=2, tp=4), 0), 2))


def test_a_link_from_chapter_3bs_fit():
    link = P.Link.from_all_reduce_fit(AlphaBeta(alpha_s=5e-5, beta=2e9), world=4)
    assert link.bus_bytes_per_s == pytest.approx(2e9 * 1.5)
    assert link.seconds("all_reduce", 1e6, 4) == pytest.approx(5e-5 + 1e6 / 2e9)


def test_every_layout_divides_the_model():
    shape = P.ModelShape(layers=6, dim=64, heads=4, seq=24, batch=8)
    found = P.layouts(shape, 8)
    assert found and all(x.gpus == 8 for x in found)
    for x in found:
        assert 4 % x.tp == 0 and 6 % x.pp == 0 and (x.cp == 1 or 24 % (2 * x.cp) == 0)
    assert P.Layout(dp=2, tp=4) in found and P.Layout(pp=8) not in found  # 8 stages, 6 blocks
    assert not any(x.cp == 8 for x in found)  # 24 tokens: no ring of 8 (needs 16 | 24)


def test_the_planner_picks_the_fastest_layout_that_fits():
    # 4 billion parameters on 8 GPUs of 80 GB: data parallelism alone does not fit
    # (Adam in mixed precision: 16 bytes a parameter, 64 GB, plus the activations)
    shape = P.ModelShape(layers=32, dim=3072, heads=24, seq=4096, batch=32, vocab=50304)
    plans = P.plan(shape, 8, P.H100, zero="replicated")
    by = {str(p.layout): p for p in plans}
    assert not by["dp8 tp1 pp1 cp1"].fits
    chosen = P.best(plans)
    assert chosen.fits and chosen.memory.total <= 0.9 * 80e9
    assert all(p.time.total >= chosen.time.total for p in plans if p.fits)
    assert chosen.time.total == min(p.time.total for p in plans if p.fits)
    with pytest.raises(ConfigError, match="no layout fits in memory"):
        P.best(P.plan(P.ModelShape(layers=8, dim=16384, heads=128, seq=8192, batch=8,
                                   vocab=50304), 2, P.H100))


@pytest.mark.parametrize(("layout", "gpus", "message"), [
    (P.Layout(dp=3, tp=2), 8, "holds 6 GPUs, not 8"),
    (P.Layout(pp=8), 8, "pp=8 stages for 6 blocks: more stages than blocks"),
    (P.Layout(pp=4), 4, "6 blocks do not split evenly over pp=4"),
    (P.Layout(cp=8), 8, "24 tokens cannot be split by a ring of cp=8"),
    (P.Layout(tp=8), 8, "4 heads do not split over tp=8"),
    (P.Layout(dp=3), 3, "batch of 8 sequences does not split over dp=3"),
    (P.Layout(pp=2, micro_batch=8), 2, "1f1b on 2 processes needs at least 2 micro-batches"),
])
def test_nonsense_layouts_end_in_one_line(layout, gpus, message):
    shape = P.ModelShape(layers=6, dim=64, heads=4, seq=24, batch=8)
    with pytest.raises(ConfigError, match=message):
        P.predict(shape, layout, hand_hardware()) if layout.gpus == gpus else \
            P.check_layout(shape, layout, gpus)


def test_predictions_beside_measurements():
    shape = P.ModelShape(layers=4, dim=64, heads=4, seq=32, batch=8)
    hw = hand_hardware()
    layout = P.Layout(pp=2, micro_batch=2)
    predicted = P.step_time(shape, layout, hw).total * 1e3
    (row,) = P.compare([P.Measurement("1f1b p=2", shape, layout, 2 * predicted)], hw)
    assert (row.label, row.layout) == ("1f1b p=2", "dp1 tp1 pp2 cp1")
    assert row.predicted_ms == pytest.approx(predicted)
    assert row.error_pct == pytest.approx(-50)


def test_cpu_processes_share_the_cores():
    link = P.Link(1e-4, 1e9)
    assert P.cpu_hardware(1e10, link, processes=8, cores=2).peak_flops == pytest.approx(2.5e9)
    assert P.cpu_hardware(1e10, link, processes=2, cores=16).peak_flops == 1e10
    rate = P.matmul_flops(n=128, repeats=2)
    assert math.isfinite(rate) and rate > 1e7
    # the small GPT reaches a fraction of that: per-call costs, not FLOPs, set its time
    assert 0 < P.fitted_efficiency(SMALL, 2, rate, repeats=2) < 1


def test_the_chapters_measurements_become_planner_rows():
    from tutorial_utils.bench import planner_check
    from tutorial_utils.bench.pipeline_schedules import PipelineSchedulesConfig, ScheduleRow

    cfg = PipelineSchedulesConfig(stages=(2,), micro_batches=(4,), dim=64, heads=4, layers=8,
                                  seq=32, micro_batch=2)
    row = ScheduleRow("zbv", 2, 4, 4, step_ms=50.0, work_ms=10.0, bubble_measured=0.2,
                      bubble_predicted=0.0, in_flight=2, in_flight_predicted=2,
                      activation_mb=1.0)
    (m,) = planner_check.from_schedules([row], cfg)
    assert (m.model.batch, m.layout.pp, m.layout.schedule, m.recipe.value_bytes) == (8, 2, "zbv",
                                                                                     4)
    link = planner_check.cpu_link({"all_reduce": AlphaBeta(1e-4, 1e9)}, processes=2)
    errors = P.compare([m], P.cpu_hardware(1e10, link, processes=2, cores=2))
    t = P.step_time(m.model, m.layout, P.cpu_hardware(1e10, link, 2, 2), m.recipe)
    assert t.bubble == 0 and t.pp == pytest.approx(2 * 2 * 4 * (1e-4 + 2 * 32 * 64 * 4 / 1e9))
    text = planner_check.error_table(errors)
    assert "zbv m=4" in text and "dp1 tp1 pp2 cp1" in text and "%" in text
