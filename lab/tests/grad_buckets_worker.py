"""Under torchrun (2 processes): GradBuckets trains like DDP, and says what it cannot do.

    torchrun --nproc_per_node=2 tests/workers/grad_buckets.py cpu|cuda

Each rank trains on its own batches. Three SGD steps with GradBuckets (many small buckets, a
channels_last network) give the weights DDP gives, on every rank; on GPUs the GradBuckets
steps are replayed from one CUDA graph, all-reduces included. With the buckets all-reduced in
bfloat16 the weights stay close to DDP's and equal on every rank. On GPUs the same holds for
the copy-engine transport (peers' buckets pulled from symmetric memory), in float32 and in
bfloat16, and for AveragingSGD, which averages those rows in its own update (paused, it
applies each rank's own gradient). Then: averaged BatchNorm statistics are the mean of the
ranks' own; paused, the gradients stay each rank's own; a parameter left out of the loss is a
clear error. Prints "grad_buckets ok".
"""

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lab.grad_buckets import AveragingSGD, GradBuckets
from torch import nn

from tutorial_utils.parallel.ddp import ddp
from tutorial_utils.parallel.distributed import distributed
from tutorial_utils.step_graph import StepGraph

SGD = dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3)


def small_net() -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(16, 10))


def graph_sgd(params, device) -> torch.optim.SGD:
    """SGD that may be stepped inside a CUDA graph: fused, reading its lr from a tensor."""
    return torch.optim.SGD(params, **{**SGD, "lr": torch.tensor(SGD["lr"], device=device)},
                           fused=True)


def trained(ctx, batches, use_buckets: bool, capture: bool, wire_dtype=None,
            transport="all-reduce", averaging=False) -> torch.Tensor:
    torch.manual_seed(ctx.rank)  # different initial weights: both must broadcast rank 0's
    net = small_net().to(ctx.device, memory_format=torch.channels_last)
    x, y = (t.clone() for t in batches[0])
    with StepGraph(ctx.device, enabled=capture) as graph:
        with graph.stream():
            sync = GradBuckets(net, ctx, 0.002, wire_dtype, transport) if use_buckets else None
            model = net if use_buckets else ddp(net, ctx)
        opt = AveragingSGD(sync, **SGD) if averaging else graph_sgd(net.parameters(), ctx.device)

        def body():
            F.cross_entropy(model(x), y).backward()
            if sync:
                sync.wait()
            opt.step()

        step = graph.capture(body, net, opt, warmup=2)
        for bx, by in batches:
            x.copy_(bx)
            y.copy_(by)
            step()
        if sync:
            assert len(sync.buckets) > 2, "the test wants several buckets"
            sync.close()
    return torch.cat([p.detach().flatten() for p in net.parameters()])


def gathered(t: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    everyone = [torch.empty_like(t) for _ in range(world_size)]
    dist.all_gather(everyone, t.contiguous())
    return everyone


def check_average_buffers(ctx, batches) -> None:
    net = small_net().to(ctx.device)
    with GradBuckets(net, ctx) as sync:
        net(batches[0][0])  # each rank's own batch moves its BatchNorm statistics
        before = gathered(net[1].running_mean.clone(), ctx.world_size)
        assert not torch.equal(before[0], before[1])
        sync.average_buffers()
        after = gathered(net[1].running_mean, ctx.world_size)
        torch.testing.assert_close(after[0], after[1], rtol=0, atol=0)
        torch.testing.assert_close(after[0], sum(before) / ctx.world_size)


def check_pause_and_unused(ctx, batches) -> None:
    net = small_net().to(ctx.device)
    extra = nn.Linear(2, 2).to(ctx.device)  # never used by the loss
    x, y = batches[0]
    with GradBuckets(net, ctx) as sync:
        with sync.pause():
            F.cross_entropy(net(x), y).backward()
            sync.wait()
        everyone = gathered(net[-1].bias.grad, ctx.world_size)
        assert not torch.equal(everyone[0], everyone[1]), "paused, yet the gradients agree"
    holder = nn.ModuleDict({"net": net, "extra": extra})
    with GradBuckets(holder, ctx, bucket_mb=1000) as sync:  # one bucket: it never fills
        net.zero_grad(set_to_none=True)
        F.cross_entropy(net(x), y).backward()
        try:
            sync.wait()
        except RuntimeError as err:
            assert "2 parameter(s) got no gradient" in str(err), err
        else:
            raise AssertionError("an unused parameter went unnoticed")


def check_paused_averaging_sgd(ctx, batches) -> None:
    net = small_net().to(ctx.device)
    x, y = batches[0]
    with GradBuckets(net, ctx, transport="copy-engine") as sync:
        opt = AveragingSGD(sync, **SGD)
        start = torch.cat([p.detach().flatten() for p in net.parameters()])
        with sync.pause():
            F.cross_entropy(net(x), y).backward()
            sync.wait()
            opt.step()
        flat = torch.nn.Parameter(start.clone())  # the same step, on this rank's gradient
        flat.grad = torch.cat([p.grad.flatten() for p in net.parameters()])
        torch.optim.SGD([flat], **SGD).step()
        after = torch.cat([p.detach().flatten() for p in net.parameters()])
        torch.testing.assert_close(after, flat.detach())
        everyone = gathered(after, ctx.world_size)
        assert not torch.equal(everyone[0], everyone[1]), "paused, yet the ranks agree"


device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
with distributed(device) as ctx:
    gen = torch.Generator(device=ctx.device).manual_seed(100 + ctx.rank)
    batches = [(torch.randn(8, 3, 8, 8, device=ctx.device, generator=gen)
                .contiguous(memory_format=torch.channels_last),
                torch.randint(0, 10, (8,), device=ctx.device, generator=gen)) for _ in range(3)]
    capture = ctx.device.type == "cuda"
    reference = trained(ctx, batches, use_buckets=False, capture=False)
    mine = trained(ctx, batches, use_buckets=True, capture=capture)
    torch.testing.assert_close(mine, reference, rtol=1e-5, atol=1e-6)
    narrow = trained(ctx, batches, use_buckets=True, capture=capture, wire_dtype=torch.bfloat16)
    assert not torch.equal(narrow, mine), "bf16 on the wire changed nothing"
    torch.testing.assert_close(narrow, reference, rtol=0, atol=1e-3)
    results = [mine, narrow]
    if ctx.device.type == "cuda":
        pulled = trained(ctx, batches, True, capture, transport="copy-engine")
        torch.testing.assert_close(pulled, reference, rtol=1e-5, atol=1e-6)
        pulled_bf16 = trained(ctx, batches, True, capture, torch.bfloat16, "copy-engine")
        assert not torch.equal(pulled_bf16, pulled), "bf16 rows changed nothing"
        torch.testing.assert_close(pulled_bf16, reference, rtol=0, atol=1e-3)
        averaged = trained(ctx, batches, True, capture, transport="copy-engine", averaging=True)
        torch.testing.assert_close(averaged, reference, rtol=1e-5, atol=1e-6)
        averaged_bf16 = trained(ctx, batches, True, capture, torch.bfloat16, "copy-engine", True)
        torch.testing.assert_close(averaged_bf16, reference, rtol=0, atol=1e-3)
        results += [pulled, pulled_bf16, averaged, averaged_bf16]
        check_paused_averaging_sgd(ctx, batches)
    for weights in results:
        everyone = gathered(weights, ctx.world_size)
        torch.testing.assert_close(everyone[1], everyone[0], rtol=0, atol=0)
    check_average_buffers(ctx, batches)
    check_pause_and_unused(ctx, batches)
    if ctx.is_main:
        print("grad_buckets ok", flush=True)
