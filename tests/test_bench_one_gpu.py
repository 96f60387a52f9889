import pytest
import torch

from tutorial_utils.bench.one_gpu import (
    host_to_device_gbps,
    ladder_table,
    measure_ladder,
)
from tutorial_utils.bench.workload import LADDER, Workload, make_train_step
from tutorial_utils.timing import tf32_enabled

TINY = Workload("wrn-10-1", batch=2, warmup=0, repeats=1)
CPU = torch.device("cpu")


def test_tf32_context_restores_settings():
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    with tf32_enabled(not before[1]):
        assert torch.backends.cudnn.allow_tf32 is (not before[1])
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before


def test_train_step_trains():
    step = make_train_step(LADDER[3], TINY, CPU)  # bf16 autocast + channels_last
    assert step.x.is_contiguous(memory_format=torch.channels_last)
    losses = [float(step()) for _ in range(4)]  # the loss of each step, before its update
    assert losses[-1] < losses[0]


def test_ladder_on_cpu_measures_all_but_the_gpu_only_rung():
    results = measure_ladder(TINY, CPU, rungs=LADDER[:4])
    assert [r.rung for r in results] == [r.name for r in LADDER[:4]]
    skipped = [r for r in results if r.ms is None]
    assert [r.rung for r in skipped] == ["tf32"] and "GPU" in skipped[0].skipped
    assert all(r.images_per_s > 0 and r.host_ms > 0 for r in results if r.ms)
    table = ladder_table(results)
    assert "skipped" in table and "1.00x" in table


def test_cuda_graph_rung_is_gpu_only_and_says_why():
    graphs = LADDER[-1]
    assert graphs.compile_mode == "reduce-overhead"
    (result,) = measure_ladder(TINY, CPU, rungs=(graphs,))
    assert result.ms is None and "CUDA graphs" in result.skipped


def test_copy_bandwidth_is_skipped_without_gpu():
    assert host_to_device_gbps(1024, CPU, pinned=False) is None


def test_the_synchronisation_probe_needs_a_gpu_only_to_run():
    from tutorial_utils.bench.one_gpu import SyncRow, sync_summary

    rows = [SyncRow("lr a number", 10.0, "none"), SyncRow("lr a tensor", 11.0, "called a sync"),
            SyncRow("stats per batch", 12.0, "called a sync"), SyncRow("stats made once", 8.0,
                                                                      "none")]
    assert sync_summary(rows) == {"sync_cost": pytest.approx(0.1), "stats_cost": 0.5}


def test_the_toy_moves_to_a_device_with_its_result_unchanged_up_to_rounding():
    from tutorial_utils.bench.one_gpu import relative_error
    from tutorial_utils.toy import toy_input, toy_model

    assert relative_error(toy_model(), toy_input(), CPU) == 0.0
