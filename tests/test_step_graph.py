import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tutorial_utils.launch import torchrun
from tutorial_utils.step_graph import StepGraph

WORKERS = Path(__file__).parent / "workers"


def tiny_problem(device, seed=0):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3)).to(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(64, 8, device=device)
    y = torch.randint(0, 3, (64,), device=device)
    return net, opt, x, y


def test_without_a_gpu_the_step_runs_as_written_on_fresh_gradients():
    net, opt, x, y = tiny_problem("cpu")
    graph = StepGraph(torch.device("cpu"))
    calls = []

    def forward_backward():  # the optimizer runs outside, after each step
        calls.append(1)
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        return loss

    step = graph.capture(forward_backward, net, opt, warmup=3)
    assert not graph.enabled and graph.graph is None
    assert not calls  # nothing runs until the first step
    first = step()
    grads = [p.grad.clone() for p in net.parameters()]
    second = step()  # same weights, same batch: the same gradients, not twice them
    for p, g in zip(net.parameters(), grads, strict=True):
        torch.testing.assert_close(p.grad, g)
    assert torch.equal(first, second)
    losses = []
    for _ in range(5):
        losses.append(step().item())
        opt.step()
    assert losses[-1] < losses[0]


def test_capture_refuses_zero_warmup_steps():
    net, opt, x, y = tiny_problem("cpu")
    with pytest.raises(ValueError, match="warm-up"):
        StepGraph(torch.device("cpu")).capture(lambda: None, net, opt, warmup=0)


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer_in_graph", [True, False])
def test_replayed_steps_equal_eager_steps_on_new_batches(optimizer_in_graph):
    dev = torch.device("cuda")
    batches = [(torch.randn(64, 8, device=dev), torch.randint(0, 3, (64,), device=dev))
               for _ in range(4)]
    weights = []
    for capture in (False, True):
        net, opt, x, y = tiny_problem(dev)
        x.copy_(batches[-1][0])  # the warm-up trains on this; capture undoes it
        y.copy_(batches[-1][1])

        def body(net=net, opt=opt, x=x, y=y):
            with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
                loss = F.cross_entropy(net(x), y)
            loss.backward()
            if optimizer_in_graph:
                opt.step()
            return loss

        with StepGraph(dev, enabled=capture) as graph:
            step = graph.capture(body, net, opt, warmup=3)
            assert (graph.graph is not None) == capture
            for bx, by in batches:
                x.copy_(bx)
                y.copy_(by)
                step()
                if not optimizer_in_graph:
                    opt.step()  # eagerly, on the gradients the replay left
            torch.cuda.synchronize()
            weights.append(torch.cat([p.detach().flatten() for p in net.parameters()]))
        assert graph.graph is None  # released on leaving the block
    torch.testing.assert_close(weights[1], weights[0])


@pytest.mark.multigpu
def test_ddp_all_reduces_run_inside_the_replayed_graph():
    result = torchrun(str(WORKERS / "graph_ddp.py"), nproc=2, timeout_s=300, echo=False)
    assert "graph_ddp ok" in result.output


def test_step_timing_records_a_captured_run(tmp_path):
    out = tmp_path / "st.jsonl"
    args = ["--model", "wrn-10-1", "--batch", "4", "--warmup", "1", "--repeats", "2",
            "--device", "cpu", "--capture", "--out", str(out), "--trace", str(tmp_path / "t.json")]
    torchrun("tutorial_utils.workers.step_timing", args, nproc=2, timeout_s=300, echo=False)
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["capture"] and record["world_size"] == 2
    assert record["ddp_ms"] > 0 and record["no_sync_ms"] > 0 and record["host_ms"] > 0
    assert (tmp_path / "t.json").stat().st_size > 0
