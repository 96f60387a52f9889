"""The chapters' exercise solutions (``tutorial_utils.solutions.chNN``), checked on a CPU."""

import dataclasses
import math

import pytest
import torch

from tutorial_utils.parallel.tensor import tp_comm_over_compute
from tutorial_utils.solutions import (
    ch01,
    ch02,
    ch03,
    ch04,
    ch05,
    ch05b,
    ch05d,
    ch05e,
    ch06,
    ch07,
    ch08,
)
from tutorial_utils.trainer import TrainConfig


def test_ch1_output_shape_of_a_larger_input():
    predicted, measured = ch01.larger_input_shapes((16, 3, 32, 32))
    assert predicted == measured == (16, 3, 24, 28)


def test_ch1_two_backward_passes_equal_one_with_twice_the_gradient():
    from tutorial_utils.toy import toy_grad_output, toy_input, toy_model, toy_output_shape

    assert ch01.accumulation_matches_doubling()
    # the fact the solution checks, by hand: .grad adds up, so two passes hold twice one pass
    gen = torch.Generator().manual_seed(1)
    model, x = toy_model(), toy_input(gen)
    g = toy_grad_output(torch.Size(toy_output_shape()), gen)
    model(x).backward(g)
    once = [p.grad.clone() for p in model.parameters()]
    model(x).backward(g)
    for a, p in zip(once, model.parameters(), strict=True):
        assert a.abs().sum() > 0
        torch.testing.assert_close(p.grad, 2 * a)


def test_ch2_break_even_of_a_slow_first_step():
    from tutorial_utils.bench.one_gpu import break_even_steps
    from tutorial_utils.bench.workload import LADDER, RungResult

    # 10 s first step, 20 ms eager, 10 ms graphed: (10000 - 10) / 10 steps
    assert break_even_steps(10_000, 20, 10) == pytest.approx(999)
    assert math.isnan(break_even_steps(10_000, 10, 20))  # nothing saved, never pays back
    results = [RungResult(r.name, 8, 20.0, first_ms=10_000) for r in LADDER[:-1]]
    results.append(RungResult(LADDER[-1].name, 8, 10.0, first_ms=10_000))
    assert ch02.graphs_break_even(results) == pytest.approx(999)


def test_ch3_bubble_and_pipeline_prediction():
    from tutorial_utils.parallel.model_parallel import bubble_fraction

    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert ch03.micro_batches_for_bubble(4, 0.10) == 27  # 3 / (27 + 3) = 0.1
    assert bubble_fraction(4, 26) > 0.10
    assert ch03.pipelined_step_ms([3, 5], 8) == pytest.approx(3 + 5 + 7 * 5)
    with pytest.raises(ValueError, match="fraction"):
        ch03.micro_batches_for_bubble(4, 0)


def test_ch4_ring_time_and_the_ddp_band():
    seconds = 2 * 7 / 8 * 146e6 / 200e9  # about 1.28 ms
    assert ch04.all_reduce_ms(146e6) == pytest.approx(seconds * 1e3)
    none = ch04.weak_scaling_prediction(11, 12, 146e6, 8, 200)
    half = ch04.weak_scaling_prediction(11, 12, 146e6, 8, 200, hidden=0.5)
    assert none == pytest.approx(8 * 11 / (12 + seconds * 1e3))
    assert none < half < 8 * 11 / 12


def test_ch5_epoch_time_from_a_step_and_a_speedup_that_counts_compilation():
    assert ch05.epoch_seconds(10.0, 128) == pytest.approx(3.9)  # 390 full batches of 10 ms
    assert ch05.epoch_seconds(10.0, 256) == pytest.approx(1.95)  # 195 batches
    assert ch05.wall_clock_speedup(70.0, 25.0, 30.0) == pytest.approx(70 / 55)
    assert ch05.wall_clock_speedup(70.0, 25.0, 0.0) == pytest.approx(2.8)


def test_ch5b_strong_scaling_ceiling_with_free_communication():
    from tutorial_utils.bench.scaling import Run

    runs = [Run("single", "1 GPU", "eager", 1, 128, 16.0),
            Run("single", "1 GPU", "step graph", 1, 128, 11.0),
            Run("single", "1 GPU", "eager", 1, 64, 12.0),
            Run("single", "1 GPU", "step graph", 1, 64, 6.5),
            Run("strong", "DDP", "step graph", 2, 64, 7.5)]
    # The best step at 128 over the best at 64: each GPU's half is not half the time.
    assert ch05b.strong_ceiling(runs, 128, 2) == pytest.approx(11.0 / 6.5)
    with pytest.raises(ValueError, match="32 images"):
        ch05b.strong_ceiling(runs, 128, 4)


def test_ch5b_weak_scaling_predicted_for_gpu_counts_not_measured():
    grad_bytes, busbw = 146e6, 365.0  # WRN-28-10's fp32 gradients; GB/s
    predict = ch04.weak_scaling_prediction
    # 2 GPUs: the ring moves 2(N-1)/N = 1 x the bytes, 0.4 ms; 8 GPUs: 1.75 x, 0.7 ms.
    assert predict(10, 10, grad_bytes, 2, busbw) == pytest.approx(20 / 10.4)
    assert predict(10, 10, grad_bytes, 8, busbw) == pytest.approx(80 / 10.7)
    assert predict(10, 10, grad_bytes, 8, busbw, hidden=1.0) == pytest.approx(8)
    assert predict(10, 11, grad_bytes, 4, busbw, hidden=1.0) < 4  # DDP's own cost
    with pytest.raises(ValueError, match="fraction"):
        predict(10, 10, grad_bytes, 2, busbw, hidden=1.5)


def test_ch5b_exposed_communication_from_a_trace():
    from tutorial_utils.bench.timeline import NCCL, overlap

    def x(cat, name, ts, dur, tid):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid}

    # One step: backward's kernels for 3 ms, an all-reduce from 2 ms to 4 ms.
    events = [{"ph": "X", "cat": "user_annotation", "name": "step 0", "ts": 0, "dur": 10,
               "pid": 1, "tid": 1},
              x("kernel", "convolution_backward", 0, 3000, 7),
              x("kernel", "ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 2000, 2000, 20)]
    got = overlap(events)
    assert got["comm"] == NCCL
    assert (got["comm_ms"], got["overlap_ms"], got["exposed_ms"]) == pytest.approx((2, 1, 1))


def test_ch5d_time_to_accuracy_and_the_shortest_schedule():
    from tutorial_utils.bench.experiment import TrainingRun

    def run(label, accs, epoch_s=2.0):
        epochs = [{"epoch": i + 1, "test_acc": a, "train_time_s": (i + 1) * epoch_s,
                   "epoch_time_s": epoch_s} for i, a in enumerate(accs)]
        return TrainingRun(1, label, epochs, {"event": "start"})

    short, long = run("2 epochs", [0.80, 0.905]), run("3 epochs", [0.85, 0.91, 0.93])
    assert ch05d.time_to_accuracy(long, 0.91) == 4.0
    assert math.isnan(ch05d.time_to_accuracy(short, 0.92))
    assert ch05d.shortest_schedule([short, long], 0.90) is short
    assert ch05d.shortest_schedule([short, long], 0.92) is long
    assert ch05d.shortest_schedule([short, long], 0.95) is None


def test_ch5e_peak_learning_rates_and_steps_at_a_large_batch(tmp_path):
    cfg = TrainConfig(lr=0.1, out=tmp_path / "r")
    assert ch05e.peak_rates(cfg) == pytest.approx({"linear": 1.6, "sqrt": 0.4})
    assert ch05e.steps_per_run(50_000, 128, 10) == 3900
    assert ch05e.steps_per_run(50_000, 1024, 10) == 480


def test_ch5e_a_longer_warm_up_at_the_largest_batch(tmp_path):
    from tutorial_utils.bench.experiment import train
    from tutorial_utils.trainer import lr_factor

    base = TrainConfig(depth=10, width=1, epochs=6, data="synthetic", device="cpu",
                       precision="fp32", checkpoint_every=0, out=tmp_path / "r")
    cfg = ch05e.longer_warm_up(base)
    steps = 50_000 // 1024
    # the rate climbs for five epochs instead of one, to the same linear-rule peak
    assert lr_factor(cfg, steps - 1, steps) == pytest.approx(0.2)  # one epoch into five
    assert lr_factor(cfg, 5 * steps, steps) == pytest.approx(1.0)  # the peak, then the decay
    assert cfg.peak_lr(1) == pytest.approx(0.8)
    small = dataclasses.replace(cfg, batch=256)  # the solution itself, small enough for a CPU
    run = train(1, dataclasses.replace(small, epochs=2, warmup_epochs=1.5, limit_per_class=100))
    assert [e["epoch"] for e in run.epochs] == [1, 2] and run.start["peak_lr"] == 0.2


def test_ch6_zero_bytes_for_a_large_model_and_the_resume_point():
    per_gpu = ch06.zero_gb_per_gpu(7e9, 8)
    assert list(per_gpu.values()) == pytest.approx(
        [112, 7 * (4 + 12 / 8), 7 * (2 + 14 / 8), 7 * 16 / 8])
    # 50,000 // 128 = 390 steps per epoch: step 450 is in the second epoch, 60 steps redone
    assert ch06.resume_point(450, 50_000 // 128) == (2, 60)
    assert ch06.resume_point(389, 390) == (1, 389)  # a crash in the first epoch: from scratch


def test_ch7_all_reduce_time_break_even_width_and_2d_state():
    # 8192 tokens x 4096 wide x 32 blocks on 8 ranks: 4 x 32 x 1.75 x 64 MiB = 15 GB per step
    ms = ch07.tp_all_reduce_ms(8192, 4096, 32, tp=8, bus_gbps=400)
    assert ms == pytest.approx(4 * 32 * 2 * 7 / 8 * 8192 * 4096 * 2 / 400e9 * 1e3)
    dim = ch07.break_even_dim(8, flops_per_s=700e12, bus_gbps=400)
    assert tp_comm_over_compute(round(dim), 8, 700e12, 400) == pytest.approx(1, rel=1e-3)
    assert ch07.params_per_rank_2d(8e9, dp=4, tp=8) == 2.5e8


def test_ch8_micro_batches_ring_memory_and_all_to_all_bytes():
    # 7 / (m + 7) < 0.1 from m = 64 on: 7/70 is exactly 0.1, 7/71 below
    assert ch08.micro_batches_for_bubble(8, 0.10) == 64
    per_rank, whole = ch08.ring_bytes(131072, 32, 128, 8)
    # 32 heads x 16,384 queries a rank: 4 tensors of 128 bf16 values and a float32 each
    assert per_rank == 32 * 16384 * (4 * 128 * 2 + 4) and whole == 8 * per_rank
    # 16,384 tokens x 2 experts each, 7/8 of them leave the rank, out and back, 8 KiB a row
    assert ch08.all_to_all_bytes(16384, 4096, 2, 8) == 2 * 16384 * 2 * 7 / 8 * 4096 * 2
