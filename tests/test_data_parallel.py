import pytest
import torch
from torch import nn

from tutorial_utils.bench.data_parallel import Row, table_of
from tutorial_utils.devices import default_device
from tutorial_utils.parallel.collectives import ring_all_reduce_seconds
from tutorial_utils.parallel.data_parallel import data_parallel_forward, make_data_parallel
from tutorial_utils.parallel.ddp import compile_for_ddp
from tutorial_utils.parallel.distributed import DistContext


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
    text = table_of(rows)
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


def test_table_columns_line_up_with_long_names():
    rows = [Row("1 GPU", 1, 10.0, 100.0, 1.0),
            Row("DDP, CUDA graphs, no_sync (compute only)", 2, 6.0, 333.0, 1.67)]
    text = table_of(rows, "wrn-10-1")
    head, *lines = text.splitlines()[:3]
    assert len({len(head), *map(len, lines)}) == 1
    # no GPU named: no MFU; the note under the table says so, and what a step computes
    assert "MFU: none" in text and "WRN-10-1" in text and lines[0].split()[-2] == "-"
