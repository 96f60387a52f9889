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
