"""Tests of the lab's research code (run with ``python -m pytest lab/tests``)."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lab import step_timing
from lab.ghost_norm import GhostBatchNorm2d, convert_ghost_batchnorm
from lab.grad_buckets import AveragingSGD, GradBuckets, _sgd_from_rows, _views, compile_children
from torch import nn

from tutorial_utils.launch import LaunchError, torchrun
from tutorial_utils.models import WideResNet
from tutorial_utils.parallel.distributed import DistContext

HERE = Path(__file__).parent


def test_grad_buckets_leave_one_process_alone_and_refuse_bad_settings():
    one = DistContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    net = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    with GradBuckets(net, one) as sync:
        assert sync.buckets == []
        net(torch.randn(5, 4)).sum().backward()
        grads = [p.grad.clone() for p in net.parameters()]
        sync.wait()  # nothing to wait for
    for p, g in zip(net.parameters(), grads, strict=True):
        assert torch.equal(p.grad, g)
    with pytest.raises(ValueError, match="copies between GPUs; on cpu use transport="):
        GradBuckets(net, one, transport="copy-engine")
    with pytest.raises(ValueError, match="transport must be"):
        GradBuckets(net, one, transport="nvlink")
    net[2].to(torch.float64)
    with pytest.raises(ValueError, match="one dtype on one device"):
        GradBuckets(net, one)


def test_copy_engine_transport_refuses_processes_on_several_machines(monkeypatch):
    # checked before any communication: no process group needed
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    two_nodes = DistContext(rank=0, local_rank=0, world_size=2, device=torch.device("cuda", 0))
    net = nn.Linear(4, 2)
    with pytest.raises(ValueError, match="all 2 processes must run on one machine"):
        GradBuckets(net, two_nodes, transport="copy-engine")


def test_bucket_views_of_a_shared_buffer_stay_inside_their_slice_and_aligned():
    # the copy-engine transport's buckets are slices of one buffer with a row per process
    rows = torch.zeros(2, 48)
    params = [nn.Parameter(torch.ones(2, 2)), nn.Parameter(torch.ones(3))]
    views = _views(rows[1, 16:48], params)
    torch._foreach_copy_(views, [torch.ones(2, 2), torch.full((3,), 2.0)])
    assert rows[0].tolist() == [0.0] * 48
    assert rows[1].tolist() == [0] * 16 + [1] * 4 + [0] * 12 + [2] * 3 + [0] * 13
    assert [v.storage_offset() * 4 % 64 for v in views] == [0, 0]  # 64-byte aligned starts


def test_averaging_sgd_update_is_sgd_on_the_mean_of_the_rows():
    torch.manual_seed(0)
    rows = torch.randn(2, 40)
    weights = torch.randn(40)
    p = nn.Parameter(weights.clone())
    ref = torch.optim.SGD([p], lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)
    buf, lr = torch.zeros(40), torch.tensor(0.1)
    for step in range(3):
        p.grad = rows.mean(0) * (step + 1)
        ref.step()
        _sgd_from_rows(weights, buf, rows * (step + 1), lr, 0.5, 0.9, True, 5e-4)
        torch.testing.assert_close(weights, p.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(buf, ref.state[p]["momentum_buffer"], rtol=1e-6, atol=1e-7)


def test_averaging_sgd_refuses_what_it_cannot_average():
    one = DistContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    net = nn.Linear(4, 2)
    with GradBuckets(net, one) as sync, pytest.raises(ValueError, match="copy-engine"):
        AveragingSGD(sync, lr=0.1)
    with GradBuckets(net, one) as sync, pytest.raises(ValueError, match="Nesterov"):
        AveragingSGD(sync, lr=0.1, nesterov=True)


def test_compile_children_compiles_only_the_children_with_parameters():
    net = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    assert compile_children(net, "none") is net
    assert all(m._compiled_call_impl is None for m in net)
    compile_children(net, "default")  # lazy: nothing compiles before the first call
    assert [m._compiled_call_impl is not None for m in net] == [True, False, True]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.multigpu)])
def test_grad_buckets_train_like_ddp_and_refuse_unused_parameters(device):
    # on GPUs the GradBuckets steps are replayed from one CUDA graph
    result = torchrun(str(HERE / "grad_buckets_worker.py"), [device], nproc=2, timeout_s=300,
                      echo=False)
    assert "grad_buckets ok" in result.output


def test_step_timing_times_grad_buckets_and_refuses_ddp_settings_with_them(tmp_path, capsys):
    out = tmp_path / "st.jsonl"
    args = ["--model", "wrn-10-1", "--batch", "4", "--warmup", "1", "--repeats", "2",
            "--device", "cpu", "--capture", "--grad-sync", "buckets", "--bucket-mb", "0.01",
            "--out", str(out)]
    torchrun("lab.step_timing", args, nproc=2, timeout_s=300, echo=False)
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["grad_sync"] == "buckets" and record["world_size"] == 2
    assert record["ddp_ms"] > 0 and record["no_sync_ms"] > 0
    with pytest.raises(LaunchError) as err:
        torchrun("lab.step_timing", [*args, "--bucket-view"], nproc=1,
                 timeout_s=120, echo=False)
    assert "--bucket-view is a DDP setting" in err.value.output
    with pytest.raises(SystemExit):  # refused before any process group or network
        step_timing.main([*args, "--optimizer", "averaging"])
    assert "add --grad-sync copy-engine" in capsys.readouterr().err


def test_step_timing_refuses_kernel_tuning_without_compilation(capsys, tmp_path):
    with pytest.raises(SystemExit):
        step_timing.main(["--tune-kernels", "--device", "cpu", "--out", str(tmp_path / "x")])
    assert "--tune-kernels tunes the kernels torch.compile generates" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_ghost_batchnorm_normalises_each_group_by_itself():
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm2d(4)
    torch.nn.init.normal_(bn.weight)
    torch.nn.init.normal_(bn.bias)
    ghost = convert_ghost_batchnorm(torch.nn.Sequential(bn), 3)[0]
    assert isinstance(ghost, GhostBatchNorm2d) and torch.equal(ghost.weight, bn.weight)
    x = torch.randn(6, 4, 5, 5) * 3 + 1
    out = ghost(x)
    groups = (slice(0, 3), slice(3, 6))
    for g in groups:  # each group normalised as a batch of its own by plain BatchNorm
        ref = F.batch_norm(x[g], None, None, bn.weight, bn.bias, training=True, eps=bn.eps)
        torch.testing.assert_close(out[g], ref)
    # the running statistics move towards the groups' mean statistics, unbiased variance
    means = torch.stack([x[g].mean(dim=(0, 2, 3)) for g in groups]).mean(0)
    variances = torch.stack([x[g].var(dim=(0, 2, 3)) for g in groups]).mean(0)
    torch.testing.assert_close(ghost.running_mean, 0.1 * means)
    torch.testing.assert_close(ghost.running_var, 0.9 + 0.1 * variances)
    out.sum().backward()
    assert ghost.weight.grad is not None
    ghost.eval()
    bn.load_state_dict(ghost.state_dict())
    bn.eval()
    torch.testing.assert_close(ghost(x), bn(x))  # evaluation: BatchNorm with those statistics


def test_ghost_batchnorm_of_one_group_is_batchnorm_and_rejects_ragged_batches():
    bn, x = torch.nn.BatchNorm2d(4), torch.randn(8, 4, 3, 3)
    ghost = GhostBatchNorm2d(4, 8)
    torch.testing.assert_close(ghost(x), bn(x))
    torch.testing.assert_close(ghost.running_var, bn.running_var)
    with pytest.raises(ValueError, match="batch of 6 does not split into ghost batches of 4"):
        GhostBatchNorm2d(4, 4)(torch.randn(6, 4, 3, 3))
    with pytest.raises(ValueError, match="at least 2 images"):
        GhostBatchNorm2d(4, 1)
    with pytest.raises(ValueError, match="needs a momentum, a scale and shift"):
        convert_ghost_batchnorm(torch.nn.BatchNorm2d(4, affine=False), 2)


def test_converted_wrn_has_no_plain_batchnorm_left_and_trains():
    model = convert_ghost_batchnorm(WideResNet(depth=10, width=1), 2)
    norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert len(norms) == 7 and all(isinstance(m, GhostBatchNorm2d) for m in norms)
    model(torch.randn(4, 3, 32, 32)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
