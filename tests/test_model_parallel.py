"""Split and pipelined models give the single-device outputs and gradients."""

import copy

import pytest
import torch
from torch import nn

from tutorial_utils.models.wrn import wide_resnet
from tutorial_utils.parallel.model_parallel import (
    ModelParallel,
    PipelinedModelParallel,
    balanced_boundaries,
    bubble_fraction,
)

CPU2 = [torch.device("cpu")] * 2


def no_bn_net():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))


def grads(model):
    return [p.grad for p in model.parameters()]


def run(model, x, y):
    out = model(x)
    nn.functional.cross_entropy(out, y.to(out.device)).backward()
    return out


@pytest.mark.parametrize("make", [no_bn_net, lambda: wide_resnet("wrn-10-1")])
def test_naive_split_matches_one_device(make):
    torch.manual_seed(0)
    ref = make()
    split = ModelParallel(copy.deepcopy(ref), CPU2)
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    torch.testing.assert_close(run(split, x, y), run(ref, x, y))
    for a, b in zip(grads(split), grads(ref), strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_pipeline_matches_one_device(m):
    torch.manual_seed(0)
    ref = no_bn_net()
    pipe = PipelinedModelParallel(copy.deepcopy(ref), CPU2, micro_batches=m)
    seen = []  # the batch sizes the first stage is given
    pipe.stages[0].register_forward_pre_hook(lambda _, args: seen.append(len(args[0])))
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
    torch.testing.assert_close(run(pipe, x, y), run(ref, x, y))
    assert seen == [16 // m] * m
    for a, b in zip(grads(pipe), grads(ref), strict=True):
        torch.testing.assert_close(a, b)


def test_pipeline_with_batchnorm_matches_in_eval_mode():
    torch.manual_seed(0)
    ref = wide_resnet("wrn-10-1").eval()
    pipe = PipelinedModelParallel(copy.deepcopy(ref), CPU2, micro_batches=4).eval()
    x = torch.randn(16, 3, 32, 32)
    torch.testing.assert_close(pipe(x), ref(x))


def test_boundaries_cover_the_layers_in_order():
    model = wide_resnet("wrn-16-2")
    for n in (1, 2, 3, len(model)):
        starts = balanced_boundaries(model, n)
        assert starts[0] == 0 and len(starts) == n and starts == sorted(set(starts))
    with pytest.raises(ValueError, match="stages"):
        balanced_boundaries(model, len(model) + 1)


def test_bubble_model():
    assert bubble_fraction(2, 1) == pytest.approx(0.5)
    assert bubble_fraction(2, 8) == pytest.approx(1 / 9)
    assert bubble_fraction(1, 4) == 0


@pytest.mark.multigpu
def test_split_over_two_gpus_matches_one_gpu(monkeypatch):
    # cuDNN convolutions default to TF32 (10-bit mantissa), and micro-batches of another size
    # get other kernels: compare in full fp32 so that only summation order differs.
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    torch.manual_seed(0)
    ref = wide_resnet("wrn-10-1").cuda()
    devs = [torch.device("cuda:0"), torch.device("cuda:1")]
    pipe = PipelinedModelParallel(copy.deepcopy(ref), devs, micro_batches=4).eval()
    x = torch.randn(32, 3, 32, 32, device="cuda:0")
    torch.testing.assert_close(pipe(x).to("cuda:0"), ref.eval()(x))


def pipeline_stage(tmp_path, *args, device="cpu", timeout_s=120):
    """One record of the torchrun worker, 2 processes."""
    from tutorial_utils.launch import torchrun

    out = tmp_path / "pipe.jsonl"
    result = torchrun("tutorial_utils.workers.pipeline_stage",
                      [*args, "--check", "--device", device, "--out", str(out)],
                      nproc=2, timeout_s=timeout_s, metrics_file=out, echo=False)
    (row,) = result.metrics
    return row


def n_params(model):
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_torch_pipelining_stages_match_one_process(tmp_path, schedule):
    from tutorial_utils.parallel.pipeline import small_net

    row = pipeline_stage(tmp_path, "--schedule", schedule)
    assert row["world_size"] == 2 and row["schedule"] == schedule
    assert (row["precision"], row["memory_format"]) == ("fp32", "contiguous")  # CPU default
    assert row["max_grad_diff"] < 1e-5
    # Each rank holds its own stage only: the counts add up to the model, none is empty.
    assert min(row["params_per_rank"]) > 0
    assert sum(row["params_per_rank"]) == n_params(small_net())


def test_torch_pipelining_runs_bf16_channels_last(tmp_path):
    # Without a contiguous stage output, sending a channels_last activation fails.
    row = pipeline_stage(tmp_path, "--bf16", "--channels-last")
    assert (row["precision"], row["memory_format"]) == ("bf16", "channels_last")
    assert row["max_grad_diff"] < 2e-2 * row["max_grad"]  # bf16 keeps 8 bits of mantissa


@pytest.mark.parametrize("n_stages", [2, 3])
def test_a_stage_materialises_only_its_layers_with_the_reference_weights(n_stages):
    from tutorial_utils.parallel.pipeline import materialise, small_net, stage_bounds

    cpu = torch.device("cpu")
    bounds = stage_bounds(small_net, n_stages, (2, 3, 32, 32))
    assert bounds[0][0] == 0 and bounds[-1][1] == len(small_net())
    reference = materialise(small_net, 0, None, cpu)  # the whole model, layer by layer
    held = 0
    for start, end in bounds:
        layers = materialise(small_net, start, end, cpu)
        assert len(layers) == end - start
        for mine, ref in zip(layers, reference[start:end], strict=True):
            for a, b in zip(mine.parameters(), ref.parameters(), strict=True):
                assert a.device == cpu
                torch.testing.assert_close(a, b, rtol=0, atol=0)
        held += sum(n_params(layer) for layer in layers)
    assert held == n_params(small_net())


def test_pipeline_benchmark_runs_and_predicts_every_m():
    from tutorial_utils.bench import model_parallel as mp

    cfg = mp.ModelParallelConfig(model="wrn-10-1", batch=8, micro_batches=(1, 2), repeats=1)
    rows, devices = mp.run(cfg)
    assert [r.name for r in rows][:2] == ["1 device", "naive split, 2 devices"]
    assert [r.micro_batches for r in rows[2:]] == [1, 2]
    assert all(r.measured_ms > 0 and r.predicted_ms > 0 for r in rows[2:])
    assert "bubble" in mp.table_of(rows, 2) and len(devices) == 2
    assert mp.from_rows(mp.rows_of(rows, {})) == (rows, {})  # what a record keeps, and reads
    fastest = min(rows[2:], key=lambda r: r.measured_ms)
    assert mp.summary(rows)["best_m"] == fastest.micro_batches


@pytest.mark.parametrize("kwargs, message", [
    ({"batch": 8, "micro_batches": (16,)}, "every m must be in 1..--batch"),
    ({"micro_batches": ()}, "at least one m"), ({"micro_batches": (0,)}, "every m"),
    ({"devices": 0}, "--devices"), ({"repeats": 0}, "--repeats"), ({"model": "x"}, "--model")])
def test_bad_benchmark_settings_are_one_line_errors(kwargs, message):
    from tutorial_utils.bench.model_parallel import ModelParallelConfig
    from tutorial_utils.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        ModelParallelConfig(**kwargs)


@pytest.mark.multigpu
def test_torch_pipelining_on_two_gpus_in_fp32(tmp_path):
    row = pipeline_stage(tmp_path, "--schedule", "1f1b", "--no-bf16", "--no-channels-last",
                         device="cuda", timeout_s=300)
    assert (row["precision"], row["memory_format"]) == ("fp32", "contiguous")
    assert row["max_grad_diff"] < 1e-4  # cuDNN's TF32 convolutions, not the pipeline


@pytest.mark.multigpu
def test_torch_pipelining_on_two_gpus_runs_like_the_in_process_pipeline(tmp_path):
    row = pipeline_stage(tmp_path, "--schedule", "1f1b", device="cuda", timeout_s=300)
    assert (row["precision"], row["memory_format"]) == ("bf16", "channels_last")
    assert row["cudnn_benchmark"]
    assert row["max_grad_diff"] < 2e-2 * row["max_grad"]


def test_flop_balanced_stages_share_the_arithmetic():
    from tutorial_utils.parallel.model_parallel import forward_flops

    with torch.device("meta"):
        model = wide_resnet("wrn-28-10")
        costs = forward_flops(model, torch.empty(1, 3, 32, 32))
    total = sum(costs)
    for n in (2, 4):
        starts = balanced_boundaries(model, n, costs)
        ends = [*starts[1:], len(model)]
        shares = [sum(costs[a:b]) / total for a, b in zip(starts, ends, strict=True)]
        assert max(shares) < 1.2 / n, shares  # within 20 % of an even split
    # parameters are a poor proxy: the last group holds most of them
    by_params = balanced_boundaries(model, 2)
    assert sum(costs[: by_params[1]]) / total > 0.7
