"""The chapters' exercise solutions, checked (every one runs on a CPU)."""

import math

import pytest

from tutorial_utils.bench_one_gpu import break_even_steps
from tutorial_utils.toy import accumulation_matches_doubling, toy_model, toy_output_shape


def test_ch1_output_shape_of_a_larger_input():
    import torch

    assert toy_output_shape((16, 3, 32, 32)) == (16, 3, 24, 28)
    assert tuple(toy_model()(torch.zeros(16, 3, 32, 32)).shape) == (16, 3, 24, 28)


def test_ch1_two_backward_passes_equal_one_with_twice_the_gradient():
    assert accumulation_matches_doubling()


def test_ch2_break_even_of_a_slow_first_step():
    # 10 s first step, 20 ms eager, 10 ms graphed: (10000 - 10) / 10 steps
    assert break_even_steps(10_000, 20, 10) == pytest.approx(999)
    assert math.isnan(break_even_steps(10_000, 10, 20))  # nothing saved, never pays back


def test_ch5e_peak_learning_rates_and_steps_at_a_large_batch(tmp_path):
    from tutorial_utils.experiment import steps_per_run, with_batch
    from tutorial_utils.train import TrainConfig

    cfg = TrainConfig(lr=0.1, out=tmp_path / "r")
    assert with_batch(cfg, 2048).peak_lr(1) == pytest.approx(1.6)
    assert with_batch(cfg, 2048, "sqrt").peak_lr(1) == pytest.approx(0.4)
    assert steps_per_run(50_000, 128, 10) == 3900 and steps_per_run(50_000, 1024, 10) == 480


def test_ch5e_a_longer_warm_up_at_the_largest_batch(tmp_path):
    import dataclasses

    from tutorial_utils.experiment import train, with_batch
    from tutorial_utils.train import TrainConfig
    from tutorial_utils.trainer import lr_factor

    base = TrainConfig(depth=10, width=1, epochs=6, data="synthetic", device="cpu", bf16=False,
                       checkpoint_every=0, out=tmp_path / "r")
    cfg = dataclasses.replace(with_batch(base, 1024, "linear"), warmup_epochs=5)
    steps = 50_000 // 1024
    # the rate climbs for five epochs instead of one, to the same linear-rule peak
    assert lr_factor(cfg, steps - 1, steps) == pytest.approx(0.2)  # one epoch into five
    assert lr_factor(cfg, 5 * steps, steps) == pytest.approx(1.0)  # the peak, then the decay
    assert cfg.peak_lr(1) == pytest.approx(0.8)
    small = dataclasses.replace(cfg, batch=256)  # the solution itself, small enough for a CPU
    run = train(1, dataclasses.replace(small, epochs=2, warmup_epochs=1.5))
    assert [e["epoch"] for e in run.epochs] == [1, 2] and run.start["peak_lr"] == 0.2


def test_ch5_epoch_time_from_a_step_and_a_speedup_that_counts_compilation():
    from tutorial_utils.experiment import epoch_seconds, wall_clock_speedup

    assert epoch_seconds(10.0, 128) == pytest.approx(3.9)  # 390 full batches of 10 ms
    assert epoch_seconds(10.0, 256) == pytest.approx(1.95)  # 195 batches
    assert wall_clock_speedup(70.0, 25.0, 30.0) == pytest.approx(70 / 55)
    assert wall_clock_speedup(70.0, 25.0, 0.0) == pytest.approx(2.8)


def test_ch5b_strong_scaling_ceiling_with_free_communication():
    from tutorial_utils.bench_scaling import Run, strong_ceiling

    runs = [Run("single", "1 GPU", "eager", 1, 128, 16.0),
            Run("single", "1 GPU", "step graph", 1, 128, 11.0),
            Run("single", "1 GPU", "eager", 1, 64, 12.0),
            Run("single", "1 GPU", "step graph", 1, 64, 6.5),
            Run("strong", "DDP", "step graph", 2, 64, 7.5)]
    # The best step at 128 over the best at 64: each GPU's half is not half the time.
    assert strong_ceiling(runs, 128, 2) == pytest.approx(11.0 / 6.5)
    with pytest.raises(ValueError, match="32 images"):
        strong_ceiling(runs, 128, 4)


def test_ch5b_weak_scaling_predicted_for_gpu_counts_not_measured():
    from tutorial_utils.parallel.ddp import weak_scaling_prediction

    grad_bytes, busbw = 146e6, 365.0  # WRN-28-10's fp32 gradients; GB/s
    # 2 GPUs: the ring moves 2(N-1)/N = 1 x the bytes, 0.4 ms; 8 GPUs: 1.75 x, 0.7 ms.
    assert weak_scaling_prediction(10, 10, grad_bytes, 2, busbw) == pytest.approx(20 / 10.4)
    assert weak_scaling_prediction(10, 10, grad_bytes, 8, busbw) == pytest.approx(80 / 10.7)
    assert weak_scaling_prediction(10, 10, grad_bytes, 8, busbw, hidden=1.0) == pytest.approx(8)
    assert weak_scaling_prediction(10, 11, grad_bytes, 4, busbw, hidden=1.0) < 4  # DDP's own cost
    with pytest.raises(ValueError, match="fraction"):
        weak_scaling_prediction(10, 10, grad_bytes, 2, busbw, hidden=1.5)


def test_ch5b_exposed_communication_from_a_trace():
    from tutorial_utils.timeline import NCCL, overlap

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


def test_ch3_bubble_and_pipeline_prediction():
    from tutorial_utils.parallel.model_parallel import (
        bubble_fraction,
        micro_batches_for_bubble,
        pipeline_ms,
    )

    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert micro_batches_for_bubble(4, 0.10) == 27  # 3 / (27 + 3) = 0.1
    assert bubble_fraction(4, 26) > 0.10
    assert pipeline_ms([3, 5], 8) == pytest.approx(3 + 5 + 7 * 5)


def test_ch4_ring_time_and_the_ddp_band():
    from tutorial_utils.parallel.ddp import ring_all_reduce_seconds, weak_scaling_prediction

    seconds = ring_all_reduce_seconds(146e6, 8, 200)
    assert seconds == pytest.approx(2 * 7 / 8 * 146e6 / 200e9)  # about 1.28 ms
    none = weak_scaling_prediction(11, 12, 146e6, 8, 200)
    half = weak_scaling_prediction(11, 12, 146e6, 8, 200, hidden=0.5)
    assert none == pytest.approx(8 * 11 / (12 + seconds * 1e3))
    assert none < half < 8 * 11 / 12


def test_ch6_zero_bytes_for_a_large_model_and_the_resume_point():
    from tutorial_utils.parallel.fsdp import zero_bytes_per_param
    from tutorial_utils.trainer import resume_point

    per_gpu = [zero_bytes_per_param(s, "adam", 8) * 7e9 / 1e9 for s in range(4)]
    assert per_gpu == pytest.approx([112, 7 * (4 + 12 / 8), 7 * (2 + 14 / 8), 7 * 16 / 8])
    # 50,000 / 128 = 390 steps per epoch: step 450 is in epoch 1 (0-based), 60 steps redone
    assert resume_point(450, 50_000 // 128) == (1, 60)
