import json
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tutorial_utils.bench import timeline
from tutorial_utils.launch import LaunchError, torchrun
from tutorial_utils.models.wrn import wide_resnet
from tutorial_utils.step_graph import (
    ReplayWatchdog,
    StepGraph,
    _check_grads_unchanged,
    _check_lr,
)

WORKERS = Path(__file__).parent / "workers"


def tiny_problem(device, seed=0, tensor_lr=False):
    """With ``tensor_lr``, an SGD that may run inside the graph: fused, reading a tensor lr."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3)).to(device)
    lr = torch.tensor(0.1, device=device) if tensor_lr else 0.1
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9, fused=tensor_lr or None)
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
        net, opt, x, y = tiny_problem(dev, tensor_lr=optimizer_in_graph)
        # the lr changes every step: a replayed optimizer must read it from its tensor
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
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
                sched.step()
            torch.cuda.synchronize()
            weights.append(torch.cat([p.detach().flatten() for p in net.parameters()]))
        assert graph.graph is None  # released on leaving the block
    torch.testing.assert_close(weights[1], weights[0])


@pytest.mark.gpu
def test_capture_puts_back_every_state_its_warm_up_changed():
    dev = torch.device("cuda")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 3)).to(dev)
    opt = torch.optim.SGD(net.parameters(), lr=torch.tensor(0.1, device=dev), momentum=0.9,
                          fused=True)
    x, y = torch.randn(64, 8, device=dev), torch.randint(0, 3, (64,), device=dev)
    before = {k: v.clone() for k, v in net.state_dict().items()}

    def body():  # the warm-up steps change weights, BatchNorm's statistics and momentum
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        return loss

    with StepGraph(dev) as graph:
        graph.capture(body, net, opt, warmup=3)
        torch.cuda.synchronize()
        after = net.state_dict()
        changed = [k for k in before if not torch.equal(after[k], before[k])]
        assert not changed, changed  # weights, running statistics, num_batches_tracked
        momenta = [s["momentum_buffer"] for s in opt.state.values()]
        assert momenta and all(torch.count_nonzero(m) == 0 for m in momenta)  # as if new


@pytest.mark.multigpu
def test_ddp_all_reduces_run_inside_the_replayed_graph():
    result = torchrun(str(WORKERS / "graph_ddp.py"), nproc=2, timeout_s=300, echo=False)
    assert "graph_ddp ok" in result.output


def test_step_timing_records_a_captured_run(tmp_path):
    out = tmp_path / "st.jsonl"
    args = ["--model", "wrn-10-1", "--batch", "4", "--warmup", "1", "--repeats", "2",
            "--device", "cpu", "--capture", "--optimizer", "fused", "--out", str(out),
            "--trace", str(tmp_path / "t.json")]
    torchrun("tutorial_utils.bench.workers.step_timing", args, nproc=2, timeout_s=300, echo=False)
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["capture"] and record["world_size"] == 2
    n_params = sum(p.numel() for p in wide_resnet("wrn-10-1").parameters())
    assert record["grad_bytes"] == 4 * n_params  # the all-reduce the ring model is fed
    assert record["bus_gbps"] > 0 and record["optimizer"] == "fused"
    assert len(timeline.step_starts(timeline.load(tmp_path / "t.json"))) == 5


@pytest.mark.gpu
def test_step_timing_captures_and_times_the_step_on_a_gpu(tmp_path):
    # The DDP step's graph is replayed for the host clock and the trace, then the no_sync
    # step's: capturing the second hands the parameters its gradients, so the first must be
    # timed before (replaying it after would find gradients it does not write, and refuse).
    out = tmp_path / "st.jsonl"
    args = ["--model", "wrn-10-1", "--batch", "8", "--warmup", "2", "--repeats", "3",
            "--device", "cuda", "--capture", "--optimizer", "fused", "--compile", "none",
            "--out", str(out), "--trace", str(tmp_path / "t.json")]
    torchrun("tutorial_utils.bench.workers.step_timing", args, nproc=1, timeout_s=300,
             echo=False)
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["capture"] and record["device"] == "cuda:0"
    assert 0 < record["host_ms"] and 0 < record["ddp_ms"] and 0 < record["no_sync_ms"]
    assert record["gpu_kernels_ms"] > 0  # the profiled replays ran kernels
    assert len(timeline.step_starts(timeline.load(tmp_path / "t.json"))) == 5


@pytest.mark.gpu
@pytest.mark.parametrize("kernels", ["foreach", "fused"])
def test_the_eager_benchmark_step_never_waits_for_the_gpu(kernels):
    # A tensor lr in foreach SGD becomes a Python number on every step: a synchronisation
    # that cost the book's eager DDP rung 4 % against the same step with a float lr.
    from tutorial_utils.bench.workers.step_timing import StepTimingConfig, make_optimizer

    net = wide_resnet("wrn-10-1").cuda()
    for capture in (False, True):
        cfg = StepTimingConfig(model="wrn-10-1", device="cuda", optimizer="fused" if capture
                               else kernels, capture=capture)
        opt = make_optimizer(cfg, net)
        net(torch.randn(4, 3, 32, 32, device="cuda")).sum().backward()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            opt.step()  # the lr a recorded step needs (a tensor, fused) does not wait either
        finally:
            torch.cuda.set_sync_debug_mode(0)
        opt.zero_grad(set_to_none=True)


class FakeEvent:
    def __init__(self, done=False):
        self.done = done

    def query(self):
        return self.done


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_watchdog_times_out_a_replay_that_never_finishes():
    clock, fired = FakeClock(), []
    dog = ReplayWatchdog(10.0, lambda: fired.append(clock.now), clock=clock)
    dog.watch(FakeEvent(done=False))
    clock.now = 9.0
    assert not dog.check() and not fired
    clock.now = 10.5
    assert dog.check() and fired == [10.5]


def test_watchdog_leaves_replays_that_finish_alone():
    clock, fired = FakeClock(), []
    dog = ReplayWatchdog(10.0, lambda: fired.append(clock.now), clock=clock)
    first, second = FakeEvent(), FakeEvent()
    dog.watch(first)
    dog.watch(second)  # queued at 0 behind the first
    clock.now = 8.0
    first.done = True
    assert not dog.check()  # the second could only start at 8
    clock.now = 15.0
    assert not dog.check()
    second.done = True
    clock.now = 1000.0
    assert not dog.check() and not fired


def test_watchdog_thread_calls_back_and_stops_when_the_graph_is_released():
    fired = threading.Event()
    dog = ReplayWatchdog(0.05, fired.set)
    dog.start()
    dog.watch(FakeEvent(done=False))
    assert fired.wait(timeout=10)  # the thread ends the wait, with the real clock
    dog.stop()
    graph = StepGraph(torch.device("cpu"), timeout_s=600)
    graph.watchdog.start()
    thread = graph.watchdog.thread
    assert thread.is_alive()
    t0 = time.monotonic()
    graph.release()
    assert not thread.is_alive() and graph.watchdog.thread is None
    assert time.monotonic() - t0 < 5  # it does not sleep out its polling interval


def test_zero_grad_between_replays_is_refused():
    net, opt, x, y = tiny_problem("cpu")
    F.cross_entropy(net(x), y).backward()
    params = list(net.parameters())
    captured = [p.grad for p in params]
    opt.zero_grad(set_to_none=False)  # in place: the graph's tensors stay
    _check_grads_unchanged(params, captured)
    opt.zero_grad()  # set_to_none=True, the default
    with pytest.raises(RuntimeError, match=r"zero_grad\(set_to_none=False\)"):
        _check_grads_unchanged(params, captured)


def test_an_optimizer_with_a_float_lr_is_refused_inside_the_step():
    net, opt, x, y = tiny_problem("cpu")
    before = [p.detach().clone() for p in net.parameters()]

    def body():
        F.cross_entropy(net(x), y).backward()
        opt.step()

    step = StepGraph(torch.device("cpu")).capture(body, net, opt)
    with pytest.raises(ValueError, match=r"lr=torch\.tensor\(0\.1, device=device\), fused=True"):
        step()
    for p, b in zip(net.parameters(), before, strict=True):  # refused before the update
        assert torch.equal(p, b)
    opt.step()  # outside the step a float lr is fine (the scheduler reaches it)


def test_a_tensor_lr_is_accepted_and_the_scheduler_reaches_it():
    net, opt, x, y = tiny_problem("cpu", tensor_lr=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    lr = opt.param_groups[0]["lr"]

    def body():
        F.cross_entropy(net(x), y).backward()
        opt.step()

    step = StepGraph(torch.device("cpu")).capture(body, net, opt)
    for _ in range(3):
        step()
        sched.step()
    assert opt.param_groups[0]["lr"] is lr and lr.item() == pytest.approx(0.1 / 8)


def test_a_recorded_step_needs_an_optimizer_that_reads_its_tensor_lr_on_the_device():
    net = nn.Linear(2, 2)
    lr = torch.tensor(0.1)
    foreach = torch.optim.SGD(net.parameters(), lr=lr, foreach=True)
    _check_lr(foreach, capturing=False)  # eagerly, any tensor lr will do
    with pytest.raises(ValueError, match="fused=True"):
        _check_lr(foreach, capturing=True)  # a recorded foreach step bakes lr.item() in
    _check_lr(torch.optim.SGD(net.parameters(), lr=lr, fused=True), capturing=True)
    _check_lr(torch.optim.Adam(net.parameters(), lr=lr, capturable=False, fused=True), True)


@pytest.mark.gpu
def test_zero_grad_between_replays_raises_on_a_gpu():
    dev = torch.device("cuda")
    net, opt, x, y = tiny_problem(dev)
    with StepGraph(dev) as graph:
        step = graph.capture(lambda: F.cross_entropy(net(x), y).backward(), net, opt, warmup=2)
        step()
        opt.zero_grad(set_to_none=False)
        step()
        opt.zero_grad()
        with pytest.raises(RuntimeError, match="zero_grad"):
            step()


@pytest.mark.gpu
def test_a_replay_that_never_finishes_calls_the_watchdog():
    dev = torch.device("cuda")
    net, opt, x, y = tiny_problem(dev)
    fired = threading.Event()

    def slow_body():
        F.cross_entropy(net(x), y).backward()
        torch.cuda._sleep(2_000_000_000)  # about a second of GPU time, recorded

    with StepGraph(dev, timeout_s=0.2) as graph:
        step = graph.capture(slow_body, net, opt, warmup=1)
        graph.watchdog.on_timeout = fired.set  # instead of ending this process
        step()
        assert fired.wait(timeout=30)
        torch.cuda.synchronize()
        thread = graph.watchdog.thread
    assert not thread.is_alive()


@pytest.mark.multigpu
def test_a_peer_that_stops_replaying_ends_the_job_within_the_timeout():
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as err:
        torchrun(str(WORKERS / "graph_peer_stops.py"), nproc=2, timeout_s=240, echo=False)
    assert time.monotonic() - t0 < 120  # the stopped peer sleeps 300 s
    assert str(err.value).startswith("rank 0 failed: TimeoutError: rank 0: a replayed CUDA graph")
