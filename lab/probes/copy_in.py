"""Probe (not part of the book): the cheapest way to copy WRN-28-10's gradients into the rows.

    python scripts/probes/copy_in.py [MODEL]

GradBuckets copies each bucket's float32 gradients into its bfloat16 slice of the shared rows
before sending it. This times, on one GPU and inside a CUDA graph as in the step graph, the
ways of doing that copy for every bucket of the model's parameters (25 MB buckets):
``foreach`` (one multi-tensor copy per bucket, GradBuckets' way), ``per-tensor`` (one copy_
each), ``hybrid`` (large tensors alone, the rest multi-tensor) and ``compiled`` (each bucket's
copies compiled by torch.compile), against one contiguous copy of as many elements.
"""

import sys

import torch
from lab.grad_buckets import _groups, _span, _views

from tutorial_utils.models import wide_resnet

LARGE = 1 << 18  # elements: above this a tensor's own copy kernel runs near full bandwidth


def time_graph(fn, replays: int = 200) -> float:
    """Milliseconds per call of ``fn`` recorded as one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "wrn-28-10"
    net = wide_resnet(name).cuda().to(memory_format=torch.channels_last)
    params = [p for p in net.parameters()]
    grads = [torch.randn_like(p) for p in params]  # same shapes and strides as the params
    grad_of = {id(p): g for p, g in zip(params, grads, strict=True)}
    groups = _groups(list(reversed(params)), 25 * 2**20)
    total = sum(_span(p) for g in groups for p in g)
    row = torch.zeros(total, dtype=torch.bfloat16, device="cuda")
    buckets, offset = [], 0
    for g in groups:
        n = sum(map(_span, g))
        buckets.append((_views(row[offset:offset + n], g), [grad_of[id(p)] for p in g]))
        offset += n

    def foreach():
        for views, gs in buckets:
            torch._foreach_copy_(views, gs)

    def per_tensor():
        for views, gs in buckets:
            for v, g in zip(views, gs, strict=True):
                v.copy_(g)

    def hybrid():
        for views, gs in buckets:
            small = [(v, g) for v, g in zip(views, gs, strict=True) if g.numel() < LARGE]
            for v, g in zip(views, gs, strict=True):
                if g.numel() >= LARGE:
                    v.copy_(g)
            if small:
                torch._foreach_copy_([v for v, _ in small], [g for _, g in small])

    def copy_bucket(views, gs):
        for v, g in zip(views, gs, strict=True):
            v.copy_(g)

    compiled_copy = torch.compile(copy_bucket, dynamic=False, fullgraph=True)

    def compiled():
        for views, gs in buckets:
            compiled_copy(views, gs)

    flat_src = torch.randn(total, device="cuda")

    def contiguous():
        row.copy_(flat_src)

    results = {}
    for fn in (foreach, per_tensor, hybrid, compiled, contiguous):
        row.zero_()
        results[fn.__name__] = time_graph(fn)
        if fn is not contiguous:  # the copy must have landed, in the parameters' layout
            for views, gs in buckets:
                for v, g in zip(views, gs, strict=True):
                    assert torch.equal(v, g.to(torch.bfloat16)), fn.__name__
    nbytes = total * (4 + 2)
    print(f"{name}: {len(params)} tensors in {len(buckets)} buckets, {total / 1e6:.1f} M "
          f"elements, {nbytes / 1e6:.0f} MB read + written")
    print(f"{'copy':<12}{'ms':>8}{'TB/s':>8}")
    for k, ms in results.items():
        print(f"{k:<12}{ms:>8.3f}{nbytes / ms / 1e9:>8.2f}")


if __name__ == "__main__":
    main()
