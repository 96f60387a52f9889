"""Chapter 8: context parallelism, ring attention by hand, equal to full attention (gloo)."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tutorial_utils.bench import context as bench
from tutorial_utils.bench.workers.cp_step import CPStepConfig
from tutorial_utils.config import ConfigError
from tutorial_utils.parallel import context as cp
from tutorial_utils.workers.cp_check import CPCheckConfig

# fp32 throughout: the ring sums the softmax in another order than SDPA does
TOL = 1e-5


def test_zigzag_gives_each_rank_an_early_and_a_late_chunk():
    x = torch.arange(16)
    shards = [cp.shard(x, r, 4, zigzag=True, dim=0) for r in range(4)]
    assert shards[0].tolist() == [0, 1, 14, 15] and shards[3].tolist() == [6, 7, 8, 9]
    assert torch.equal(cp.unshard(shards, zigzag=True, dim=0), x)
    assert torch.equal(cp.positions(16, 1, 4, zigzag=True), shards[1])
    plain = [cp.shard(x, r, 4, zigzag=False, dim=0) for r in range(4)]
    assert plain[1].tolist() == [4, 5, 6, 7] and torch.equal(cp.unshard(plain, False, 0), x)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_zigzag_balances_the_causal_work(world):
    plain = [cp.causal_blocks(r, world, zigzag=False) for r in range(world)]
    zigzag = [cp.causal_blocks(r, world, zigzag=True) for r in range(world)]
    assert plain == list(range(1, world + 1))  # the last rank does N times the first's
    assert zigzag == [2 * world + 1] * world  # every rank the same, in half-size chunks


def test_the_online_softmax_of_blocks_is_the_softmax_of_all():
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 1, 5, 4).unbind(0), torch.randn(1, 12, 4), torch.randn(1, 12, 4)
    q = q[0]
    online = cp.OnlineSoftmax(q)
    for kb, vb in zip(k.split(4, 1), v.split(4, 1), strict=True):
        online.update(q @ kb.transpose(-2, -1), vb)
    out, lse = online.result()
    s = q @ k.transpose(-2, -1)
    torch.testing.assert_close(out, s.softmax(-1) @ v)
    torch.testing.assert_close(lse, s.logsumexp(-1))


@pytest.mark.parametrize("zigzag", [False, True])
def test_a_ring_of_one_is_causal_attention(zigzag):
    torch.manual_seed(0)
    q, k, v, dout = torch.randn(4, 2, 3, 16, 8).unbind(0)
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    ring = [t.clone().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*whole, is_causal=True).backward(dout)
    out = cp.ring_attention(*ring, zigzag=zigzag)
    out.backward(dout)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True),
                               atol=TOL, rtol=0)
    for a, b in zip(ring, whole, strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=TOL, rtol=0)


def test_a_sequence_the_ring_cannot_split_is_refused():
    with pytest.raises(ConfigError, match="a sequence of 12 tokens does not split over 4 ranks "
                                          "in 8 zig-zag chunks: use a multiple of 8"):
        cp.check_split(12, 4, zigzag=True)
    with pytest.raises(ConfigError, match="10 tokens does not split over 4 ranks: use a mult"):
        cp.shard(torch.zeros(10), 0, 4, zigzag=False, dim=0)
    cp.check_split(12, 4, zigzag=False)


def test_pytorch_context_parallel_on_the_cpu_says_so_in_one_line():
    with pytest.raises(ConfigError, match="^context_parallel needs CUDA GPUs .*; on the CPU use "
                                          "ring_attention$"):
        with cp.pytorch_ring(None, 16, torch.device("cpu")):
            pass


def test_the_memory_prediction():
    # q, k, v and the output, 4 values of head_dim each, and one fp32 log-sum-exp per row
    assert cp.attention_bytes_per_rank(1, 2, 64, 8, world=1) == 128 * (4 * 8 * 4 + 4)
    assert cp.attention_bytes_per_rank(1, 2, 64, 8, world=4) == 32 * (4 * 8 * 4 + 4)
    assert cp.attention_bytes_per_rank(1, 2, 64, 8, world=1, value_bytes=2) == 128 * 68


@pytest.mark.parametrize(("nproc", "seqs"), [(2, (16, 32)), (4, (16,))])
def test_every_ring_equals_full_attention(nproc, seqs):
    rows = bench.check_rows(nproc, CPCheckConfig(device="cpu", seqs=seqs))
    assert {(r.mode, r.seq) for r in rows} == {(m, s) for m in ("ring", "ring-zigzag",
                                               "gathered", "gpt") for s in seqs}
    for r in rows:
        assert r.out_diff < TOL and r.grad_diff < TOL, r
    for r in (r for r in rows if r.mode.startswith("ring")):
        assert r.saved_bytes == r.predicted_bytes  # S/N rows of q, k, v, output, lse
        assert r.blocks == tuple(cp.causal_blocks(i, nproc, r.zigzag) for i in range(nproc))
    ring, gathered = ({r.seq: r for r in rows if r.mode == m} for m in ("ring", "gathered"))
    assert all(gathered[s].saved_bytes > ring[s].saved_bytes for s in seqs)
    if 32 in seqs:
        assert ring[32].saved_bytes == 2 * ring[16].saved_bytes  # linear in the sequence
    assert "chunk pairs per rank" in bench.check_table(rows)
    assert "ring predicted KiB" in bench.memory_table(rows)


def test_the_benchmark_runs_in_cpu_processes():
    step = CPStepConfig(modes=("one-process", "ring"), seqs=(32,), heads=1, head_dim=8,
                        repeats=1, device="cpu")
    rows = bench.step_rows(bench.ContextConfig(gpus=2), step)
    assert [r.mode for r in rows] == ["one-process", "ring"]
    one, ring = rows
    assert ring.saved_mib == pytest.approx(one.saved_mib / 2) == ring.predicted_mib
    assert all(r.step_ms > 0 and r.peak_mib is None for r in rows)
    assert "fwd+bwd ms" in bench.step_table(rows)


def _one_line(args, env=None):
    done = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **(env or {})})
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    return done.stderr.strip()


def test_the_check_refuses_a_sequence_it_cannot_split_before_any_work():
    line = _one_line(["tutorial_utils.workers.cp_check", "--seqs", "12", "--device", "cpu"],
                     env={"WORLD_SIZE": "4", "RANK": "0"})
    assert line.endswith("a sequence of 12 tokens does not split over 4 ranks in 8 zig-zag "
                         "chunks: use a multiple of 8")


@pytest.mark.parametrize(("argv", "message"), [
    ("--record", "--gpus 2: asked for 2 GPU(s) but this machine has 0; use a machine with 2 "
                 "GPUs, or --device cpu"),
    ("--record --device cpu", "--record measures GPUs: leave out --device cpu"),
    ("--gpus 4 --seqs 4100", "a sequence of 4100 tokens does not split over 4 ranks in 8 "
                             "zig-zag chunks"),
    ("--gpus 1", "--gpus must be >= 2, got 1"),
])
def test_the_benchmark_refuses_nonsense_in_one_line(argv, message, capsys, monkeypatch):
    from tutorial_utils import devices

    monkeypatch.setattr(devices, "gpu_count", lambda: 0)
    monkeypatch.setattr(bench, "step_rows", None)  # reaching the work fails the test
    with pytest.raises(SystemExit) as done:
        bench.main(argv.split())
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.count("\n") == 1 and message in err, err


@pytest.mark.multigpu
def test_pytorch_context_parallel_equals_full_attention_on_two_gpus():
    rows = bench.check_rows(2, CPCheckConfig(device="cuda", seqs=(256,),
                                             modes=("ring-zigzag", "context_parallel")))
    assert [r.mode for r in rows] == ["ring-zigzag", "context_parallel"]
    for r in rows:
        assert r.out_diff < 1e-4 and r.grad_diff < 1e-4, r
