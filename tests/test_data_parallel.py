import pytest
import torch
from torch import nn

from tutorial_utils.bench_data_parallel import Row, table
from tutorial_utils.devices import default_device
from tutorial_utils.parallel.data_parallel import (
    compile_for_ddp,
    data_parallel_forward,
    make_data_parallel,
    ring_all_reduce_seconds,
)
from tutorial_utils.parallel.distributed import DistContext
from tutorial_utils.parallel.grad_buckets import (
    AveragingSGD,
    GradBuckets,
    _sgd_from_rows,
    _views,
    compile_children,
)


def test_ring_model():
    # 2(N-1)/N of the bytes at the bus bandwidth: 1 GB over 2 GPUs at 100 GB/s -> 10 ms.
    assert ring_all_reduce_seconds(1e9, 2, 100) == pytest.approx(0.010)
    assert ring_all_reduce_seconds(1e9, 4, 100) == pytest.approx(0.015)
    assert ring_all_reduce_seconds(1e9, 1, 100) == 0.0


def test_one_gpu_or_none_means_no_wrapper():
    model = make_data_parallel(nn.Linear(2, 2), 1)
    assert isinstance(model, nn.Linear)
    assert next(model.parameters()).device.type == default_device().type


def test_table_marks_skipped_runs():
    rows = [Row("1 GPU", 1, 10.0, 100.0, 1.0), Row("DataParallel", 2, None, note="skipped: x")]
    text = table(rows)
    assert "1.00x" in text and "skipped: x" in text


@pytest.mark.multigpu
def test_hand_written_data_parallel_forward_matches_nn_data_parallel():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).cuda()
    x = torch.randn(64, 8, device="cuda")
    devices = [torch.device("cuda:0"), torch.device("cuda:1")]
    manual = data_parallel_forward(net, x, devices)
    torch.testing.assert_close(manual, nn.DataParallel(net)(x))
    torch.testing.assert_close(manual, net(x))


def test_cuda_graphs_under_ddp_compile_the_network_as_one_graph():
    net = nn.Linear(4, 2)
    one, two = (DistContext(rank=0, local_rank=0, world_size=n, device=torch.device("cpu"))
                for n in (1, 2))
    assert compile_for_ddp(net, "none", two) is net
    with torch._dynamo.config.patch(optimize_ddp=True):
        compile_for_ddp(net, "reduce-overhead", one)
        assert torch._dynamo.config.optimize_ddp  # one process: nothing to split for
        compile_for_ddp(net, "default", two)
        assert torch._dynamo.config.optimize_ddp  # no CUDA graphs: keep DDP's overlap
        compiled = compile_for_ddp(net, "reduce-overhead", two)
        assert not torch._dynamo.config.optimize_ddp
    assert compiled is not net and compiled._orig_mod is net


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
