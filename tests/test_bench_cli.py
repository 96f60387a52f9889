"""The benchmarks' command lines: a nonsense option is one line on stderr (exit 2), before any work.

Each case runs a benchmark's ``main`` on a machine said to have some number of GPUs, with its
measuring function and every torchrun launch replaced by a failure: reaching either means the
bad option cost work (or was not noticed at all).
"""

import importlib
import time

import pytest
import torch

from tutorial_utils import devices
from tutorial_utils.bench import workload

# (benchmark, argv, GPUs the machine has, a fragment of the one-line message)
CASES = [
    ("model_parallel", "--batch 0", 0, "--batch must be >= 1, got 0"),
    ("model_parallel", "--batch -8", 0, "--batch must be >= 1, got -8"),
    ("model_parallel", "--batch eight", 0, "argument --batch: invalid int value: 'eight'"),
    ("model_parallel", "--micro-batches 0", 0, "every m must be in 1..--batch"),
    ("model_parallel", "--micro-batches", 0, "--micro-batches needs at least one m"),
    ("model_parallel", "--micro-batches 4 4", 0, "--micro-batches lists 4 twice"),
    ("model_parallel", "--worker-micro-batches 0", 0, "every m must be in 1..--batch"),
    ("model_parallel", "--repeats 0", 0, "--repeats must be >= 1, got 0"),
    ("model_parallel", "--devices 0", 0, "--devices must be in 2..8"),
    ("model_parallel", "--devices 1", 0, "--devices must be in 2..8"),
    ("model_parallel", "--devices 16", 0, "--devices must be in 2..8"),
    ("model_parallel", "--model resnet50", 0, "--model: a WRN name looks like 'wrn-28-10'"),
    ("model_parallel", "--batch 8 --micro-batches 16", 0, "every m must be in 1..--batch (8)"),
    ("model_parallel", "--batch 100 --micro-batches 8", 0,
     "--batch 100 is not a multiple of --micro-batches 8"),
    ("model_parallel", "--batch 12 --micro-batches 1 2 --schedules", 0,
     "--batch 12 is not a multiple of --worker-micro-batches 8"),
    ("model_parallel", "--devices 4", 2,
     "--devices 4: asked for 4 GPU(s) but this machine has 2; use --devices 2"),
    ("model_parallel", "--devices 2", 1,
     "this machine has 1; use a machine with 2 GPUs, or CUDA_VISIBLE_DEVICES="),
    ("data_parallel", "--batch 0", 0, "--batch must be >= 1, got 0"),
    ("data_parallel", "--batch -8", 0, "--batch must be >= 1, got -8"),
    ("data_parallel", "--gpus 1", 0, "--gpus must be >= 2"),
    ("data_parallel", "--gpus 0", 0, "--gpus must be >= 2"),
    ("data_parallel", "--repeats 0", 0, "--repeats must be >= 1, got 0"),
    ("data_parallel", "--warmup -1", 0, "--warmup must be >= 0, got -1"),
    ("data_parallel", "--model resnet50", 0, "--model: a WRN name looks like 'wrn-28-10'"),
    ("data_parallel", "--gpus 4", 2,
     "--gpus 4: asked for 4 GPU(s) but this machine has 2; use --gpus 2"),
    ("data_parallel", "--gpus 2", 1,
     "this machine has 1; use a machine with 2 GPUs, or CUDA_VISIBLE_DEVICES="),
    ("collectives", "--nproc 0", 0, "collectives need several processes"),
    ("collectives", "--nproc 1", 0, "collectives need several processes"),
    ("collectives", "--nproc 3", 0, "--nproc must be a power of two"),
    ("collectives", "--max-mb -5", 0, "--max-mb must be in [0.004, 8192]"),
    ("collectives", "--max-mb 0", 0, "--max-mb must be in [0.004, 8192]"),
    ("collectives", "--max-mb nan", 0, "--max-mb must be in [0.004, 8192]"),
    ("collectives", "--max-mb inf", 0, "--max-mb must be in [0.004, 8192]"),
    ("collectives", "--max-mb 100000", 0, "--max-mb must be in [0.004, 8192]"),
    ("collectives", "--factor 1", 0, "--factor must be in 2..1024, got 1"),
    ("collectives", "--factor 0", 0, "--factor must be in 2..1024, got 0"),
    ("collectives", "--factor 4096", 0, "--factor must be in 2..1024, got 4096"),
    ("collectives", "--max-mb 0.01 --factor 4", 0, "gives one message size"),
    ("collectives", "--warmup -1", 0, "--warmup must be >= 0, got -1"),
    ("collectives", "--repeats 0", 0, "--repeats must be >= 1, got 0"),
    ("collectives", "--gradients-of resnet50", 0, "--gradients-of: a WRN name looks like"),
    ("collectives", "--device cuda", 0,
     "--nproc 2: asked for 2 GPU(s) but this machine has 0; use a machine with 2 GPUs, or "
     "--device cpu"),
    ("collectives", "--nproc 4 --device cuda", 2,
     "this machine has 2; use --nproc 2, a machine with 4 GPUs"),
    ("collectives", "--nproc 2 --record", 1,
     "this machine has 1; use a machine with 2 GPUs, or leave out --record"),
    ("scaling", "--per-gpu-batch 0", 0, "the batches must be >= 1"),
    ("scaling", "--global-batch 0", 0, "the batches must be >= 1"),
    ("scaling", "--global-batch -128", 0, "the batches must be >= 1"),
    ("scaling", "--gpus 1", 0, "scaling needs 2 or more GPUs per run"),
    ("scaling", "--gpus", 0, "scaling needs 2 or more GPUs per run"),
    ("scaling", "--gpus 0", 0, "scaling needs 2 or more GPUs per run"),
    ("scaling", "--gpus 2 2", 0, "--gpus lists 2 twice"),
    ("scaling", "--warmup -1", 0, "--warmup must be >= 0, got -1"),
    ("scaling", "--repeats 0", 0, "--repeats must be >= 1, got 0"),
    ("scaling", "--model resnet50", 0, "--model: a WRN name looks like 'wrn-28-10'"),
    ("scaling", "--modes", 0, "--modes needs at least one mode"),
    ("scaling", "--modes eager eager", 0, "--modes lists eager twice"),
    ("scaling", "--modes fast", 0, "argument --modes: invalid choice: 'fast'"),
    ("scaling", "--global-batch 128 --gpus 3", 0,
     "--global-batch 128 is not divisible by 3 GPUs; use a multiple of 3"),
    ("scaling", "--device cuda", 0,
     "--gpus 2: asked for 2 GPU(s) but this machine has 0; use a machine with 2 GPUs, or "
     "--device cpu"),
    ("scaling", "--gpus 4", 2, "--gpus 4: asked for 4 GPU(s) but this machine has 2; use --gpus 2"),
    ("scaling", "--gpus 2", 1, "this machine has 1; use a machine with 2 GPUs, or --device cpu"),
    ("ddp_knobs", "--nproc 0", 0, "--nproc must be >= 1, got 0"),
    ("ddp_knobs", "--batch 0", 0, "--batch must be >= 1, got 0"),
    ("ddp_knobs", "--repeats 0", 0, "need --steps >= 1 and --repeats >= 1"),
    ("ddp_knobs", "--buckets", 0, "--buckets: sizes in MiB, each > 0"),
    ("ddp_knobs", "--buckets 0 25", 0, "--buckets: sizes in MiB, each > 0"),
    ("ddp_knobs", "--buckets 5 5", 0, "--buckets names a size twice"),
    ("ddp_knobs", "--buckets five", 0, "argument --buckets: invalid float value: 'five'"),
    ("ddp_knobs", "--model resnet50", 0, "--model: a WRN name looks like 'wrn-28-10'"),
]


class WorkStarted(Exception):
    """A benchmark measured or launched something."""


def work_started(*args, **kwargs):
    raise WorkStarted


def bench_on(name: str, gpus: int, monkeypatch):
    """The module of benchmark ``name`` on a machine with ``gpus`` GPUs, unable to work."""
    module = importlib.import_module(f"tutorial_utils.bench.{name}")
    for target in (module, workload):
        if hasattr(target, "torchrun"):
            monkeypatch.setattr(target, "torchrun", work_started)
    monkeypatch.setattr(module, "run", work_started)
    monkeypatch.setattr(module, "gpu_count", lambda: gpus)
    monkeypatch.setattr(devices, "gpu_count", lambda: gpus)
    return module


@pytest.mark.parametrize("name, argv, gpus, message", CASES,
                         ids=[f"{c[0]}:{c[1]}:{c[2]}gpu" for c in CASES])
def test_nonsense_is_one_line_before_any_work(name, argv, gpus, message, capsys, monkeypatch):
    module = bench_on(name, gpus, monkeypatch)
    start = time.perf_counter()
    with pytest.raises(SystemExit) as exit_:
        module.main(argv.split())
    assert time.perf_counter() - start < 2.0
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert captured.err.endswith("\n") and captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith(f"python -m tutorial_utils.bench.{name}: error: ")
    assert message in captured.err
    assert captured.out == ""


@pytest.mark.parametrize("name, argv", [
    ("model_parallel", "--devices 4"), ("data_parallel", "--gpus 4"),
    ("collectives", "--nproc 4"), ("scaling", "--gpus 4")])
@pytest.mark.parametrize("gpus", [0, 8])
def test_enough_gpus_or_none_at_all_start_the_work(name, argv, gpus, monkeypatch):
    # without a GPU every benchmark keeps its CPU fallback; with enough it runs on them
    with pytest.raises(WorkStarted):
        bench_on(name, gpus, monkeypatch).main(argv.split())


def test_a_cpu_run_is_asked_for_by_device_cpu_whatever_the_gpus(monkeypatch):
    # collectives on fewer GPUs than processes fall back to CPU processes by themselves
    for name, argv in (("collectives", "--nproc 4 --device cpu"), ("collectives", "--nproc 4"),
                       ("scaling", "--gpus 4 --device cpu --modes eager")):
        with pytest.raises(WorkStarted):
            bench_on(name, 1, monkeypatch).main(argv.split())


@pytest.mark.parametrize("batch", [8, 10, 12, 16, 100, 2048])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 6, 8, 16, 32])
def test_every_accepted_m_cuts_the_batch_into_m_equal_micro_batches(batch, m):
    # The pipeline cuts the batch with x.chunk(m) and labels the run "m"; the prediction times
    # micro-batches of batch // m images. Both hold only when m divides the batch.
    from tutorial_utils.bench.model_parallel import ModelParallelConfig
    from tutorial_utils.config import ConfigError

    try:
        ModelParallelConfig(batch=batch, micro_batches=(m,), worker_micro_batches=1)
    except ConfigError as err:
        assert batch % m, f"batch {batch}, m {m} refused: {err}"
        return
    chunks = torch.empty(batch, 1).chunk(m)
    assert [len(c) for c in chunks] == [batch // m] * m
