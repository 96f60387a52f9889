"""DDP's knobs (chapter 5b): each setting does what its name says, on two CPU processes."""

import inspect
import math

import pytest
from torch.nn.parallel import DistributedDataParallel

from tutorial_utils.bench import ddp_knobs
from tutorial_utils.bench.workers.ddp_knobs import KnobsRow, ddp_kwargs
from tutorial_utils.launch import torchrun


def _run(tmp_path, nproc, device, *extra):
    out = tmp_path / "knobs.jsonl"
    argv = ["--model", "wrn-10-1", "--batch", "4", "--repeats", "1", "--buckets", "0.05", "1",
            "--compiled", "--device", device, "--out", str(out), *extra]
    result = torchrun("tutorial_utils.bench.workers.ddp_knobs", argv, nproc=nproc,
                      timeout_s=600, metrics_file=out, echo=False)
    return {r.setting: r for r in map(lambda m: KnobsRow(**m), result.metrics)}


@pytest.fixture(scope="module")
def two_cpu(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("knobs"), 2, "cpu")


def test_no_knob_changes_what_is_trained(two_cpu):
    defaults = two_cpu["defaults"].losses
    assert all(r.failed is None for r in two_cpu.values()), two_cpu
    for name, r in two_cpu.items():
        assert r.losses == pytest.approx(defaults, rel=1e-5, abs=1e-6), name


def test_smaller_buckets_mean_more_all_reduces(two_cpu):
    # 0.3 MiB of gradients: one bucket of 1 MiB (and the defaults' 1 MiB first bucket), several
    # of 0.05 MiB; an all-reduce per bucket
    assert two_cpu["bucket_cap_mb=1"].all_reduces == 1 == two_cpu["defaults"].all_reduces
    assert two_cpu["bucket_cap_mb=0.05"].all_reduces >= 3


def test_the_bucket_view_puts_the_gradients_in_the_buckets(two_cpu):
    for name in ("defaults", "static_graph"):
        assert two_cpu[name].grad_storages == two_cpu[name].grad_tensors == 25, name
    for name in ("gradient_as_bucket_view", "all three"):  # one bucket: one block of memory
        assert two_cpu[name].grad_storages == 1, name


def test_without_buffer_sync_no_broadcast_per_step(two_cpu):
    assert two_cpu["defaults"].broadcasts >= 1  # BatchNorm's statistics from rank 0
    assert two_cpu["broadcast_buffers=False"].broadcasts == 0
    assert two_cpu["all three"].broadcasts == 0


def test_compiled_autograd_puts_the_all_reduces_inside_the_compiled_backward(two_cpu):
    split, one, ca = (two_cpu[n] for n in ddp_knobs.KEYS if n.startswith("compiled"))
    assert one.graphs == 1 and one.all_reduces_in_graphs == 0  # DDP's hooks, outside
    assert split.all_reduces_in_graphs == 0
    # a forward graph and a backward graph; every gradient's all-reduce inside the backward
    # (on GPUs inductor then fuses them into buckets)
    assert ca.graphs == 2 and ca.all_reduces_in_graphs == ca.all_reduces == 25


def test_buffer_sync_goes_by_its_name_in_this_torch():
    (name,) = ddp_kwargs({"broadcast_buffers": False})
    assert name in inspect.signature(DistributedDataParallel).parameters


def _row(setting, step_ms, **extra):
    return KnobsRow(**{"setting": setting, "knobs": {}, "compiled": None, "world_size": 2,
                       "step_ms": step_ms, "host_ms": 1.0, "exposed_ms": 0.5, "all_reduces": 2,
                       "broadcasts": 1, "grad_storages": 25, "grad_tensors": 25,
                       "grad_mib": 0.3, "losses": [2.0, 1.9], **extra})


def test_tables_and_summary_say_which_setting_failed_and_why():
    rows = [_row("defaults", 20.0), _row("bucket_cap_mb=5", 16.0),
            _row("bucket_cap_mb=25", 25.0),
            _row("gradient_as_bucket_view", 10.0, grad_storages=2),
            KnobsRow("compiled autograd", {}, "python_reducer",
                     failed="RuntimeError: not supported")]
    out = ddp_knobs.summary(rows)
    assert out["best_bucket"] == "5" and out["best_bucket_x"] == pytest.approx(1.25)
    assert out["view_x"] == pytest.approx(2.0)
    assert math.isnan(out["ca_ms"]) and out["ca_failed"] == "RuntimeError: not supported"
    what = ddp_knobs.what_table(rows)
    assert "failed: RuntimeError: not supported" in what and "in buckets" in what
    assert "2.00x" in ddp_knobs.cost_table(rows)


@pytest.mark.gpu
def test_every_setting_runs_on_a_gpu(tmp_path):
    rows = _run(tmp_path, 1, "cuda")
    assert all(r.failed is None for r in rows.values()), rows
    assert all(r.peak_gib > 0 for r in rows.values())
    ca = rows["compiled autograd"]
    assert ca.backend == "inductor" and ca.all_reduces_in_graphs >= 1
