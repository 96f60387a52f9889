import time

import pytest
import torch

from tutorial_utils.timing import Timing, benchmark, cold_call_ms, host_clock_without_sync


def test_statistics_of_known_samples():
    t = Timing((4.0, 1.0, 3.0, 2.0, 5.0))
    assert t.median_ms == 3.0
    assert t.q25_ms == 2.0 and t.q75_ms == 4.0
    assert t.spread == pytest.approx(2.0 / 3.0)
    assert len(t) == 5 and "3.000 ms" in str(t)


def test_benchmark_warms_up_then_times_each_repeat():
    calls = []

    def slow_at_first():  # the warm-up calls are slow, as a first step that autotunes is
        calls.append(1)
        if len(calls) <= 3:
            time.sleep(0.2)

    t = benchmark(slow_at_first, warmup=3, repeats=7, device="cpu")
    assert len(calls) == 10 and len(t) == 7
    assert max(t.samples_ms) < 100  # none of the slow (200 ms) calls was timed


def test_benchmark_measures_real_time_on_cpu():
    t = benchmark(lambda: time.sleep(0.005), warmup=1, repeats=5, device="cpu")
    assert 4.5 <= t.median_ms < 50


def test_bad_arguments():
    with pytest.raises(ValueError, match="repeats >= 1"):
        benchmark(lambda: None, repeats=0, device="cpu")
    with pytest.raises(ValueError, match="warmup >= 0"):
        benchmark(lambda: None, warmup=-1, device="cpu")


def test_cold_call_includes_the_work():
    assert cold_call_ms(lambda: time.sleep(0.01), device="cpu") >= 9.5


@pytest.mark.gpu
def test_events_see_gpu_work_the_unsynchronised_host_clock_misses():
    a = torch.randn(4096, 4096, device="cuda")

    def work():
        for _ in range(20):
            a @ a

    right = benchmark(work, warmup=2, repeats=5, device="cuda")
    torch.cuda.synchronize()
    wrong = host_clock_without_sync(work, repeats=1)
    torch.cuda.synchronize()
    # 20 fp32 4096^3 products are ~2.7 TFLOP: milliseconds of GPU time, microseconds to queue.
    assert right.median_ms > 3 * wrong.median_ms
