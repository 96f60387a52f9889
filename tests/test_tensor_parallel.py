"""Chapter 7: the GPT, its text, and tensor parallelism equal to one process (gloo)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tutorial_utils.jsonl import read_jsonl
from tutorial_utils.launch import torchrun
from tutorial_utils.models.gpt import GPT, GPTConfig, lm_loss
from tutorial_utils.parallel import tensor
from tutorial_utils.text import batch, stdlib_corpus, synthetic_corpus

SMALL = GPTConfig(seq=16, layers=2, heads=2, dim=32)


def test_the_gpt_is_causal():
    torch.manual_seed(0)
    model = GPT(SMALL).eval()
    x = torch.randint(0, 256, (2, 16))
    changed = x.clone()
    changed[:, 10] = (x[:, 10] + 1) % 256
    a, b = model(x), model(changed)
    assert a.shape == (2, 16, 256)
    torch.testing.assert_close(a[:, :10], b[:, :10])  # the past does not see the future
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_a_width_that_heads_do_not_divide_is_refused():
    with pytest.raises(ValueError, match="dim=30 must be a multiple of heads=4"):
        GPTConfig(dim=30, heads=4)


def test_activation_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    plain = GPT(SMALL)
    recomputed = GPT(SMALL, activation_checkpointing=True)
    recomputed.load_state_dict(plain.state_dict())
    x, y = torch.randint(0, 256, (2, 2, 16))
    for model in (plain, recomputed):
        lm_loss(model(x), y).backward()
    for p, q in zip(plain.parameters(), recomputed.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_a_few_steps_on_python_source_lower_the_loss():
    corpus = stdlib_corpus(max_bytes=200_000)
    torch.manual_seed(0)
    model = GPT(SMALL)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(30):
        x, y = batch(corpus.train, 16, SMALL.seq, g)
        loss = lm_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > 5.0 and sum(losses[-5:]) / 5 < losses[0] - 1.5  # ln 256 = 5.5


def test_the_corpus_is_the_same_bytes_each_time_and_windows_shift_by_one():
    a, b = stdlib_corpus(max_bytes=50_000), stdlib_corpus(max_bytes=50_000)
    assert torch.equal(a.train, b.train) and len(a.train) + len(a.val) == 50_000
    assert f"Python {sys.version_info.major}.{sys.version_info.minor}" in a.name
    x, y = batch(a.train, 3, 8, torch.Generator().manual_seed(1))
    assert x.shape == y.shape == (3, 8) and torch.equal(x[:, 1:], y[:, :-1])
    assert synthetic_corpus(20_000).name.startswith("synthetic")


def test_no_python_source_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="found only 0 bytes of Python source"):
        stdlib_corpus(root=tmp_path)
    with pytest.raises(ValueError, match="fewer than a window"):
        batch(torch.zeros(8, dtype=torch.uint8), 1, 8, torch.Generator())


def test_the_cost_arithmetic():
    tokens, dim, layers = 4096, 768, 12
    tp = tensor.tp_bytes_per_step(tokens, dim, layers, tp=2)
    assert tp == 4 * layers * tokens * dim * 2  # 2(N-1)/N = 1 on two ranks
    n_params = 12 * dim**2 * layers  # the blocks' weights
    fsdp = tensor.fsdp_bytes_per_step(n_params, world=2)
    assert tp / fsdp == pytest.approx(tokens / (9 * dim))
    ratio = tensor.tp_comm_over_compute(dim, 2, flops_per_s=500e12, bus_gbps=250)
    assert tensor.tp_comm_over_compute(2 * dim, 2, 500e12, 250) == pytest.approx(ratio / 2)
    assert tensor.tp_comm_over_compute(dim, 2, 1000e12, 250) == pytest.approx(2 * ratio)


def _check(nproc, tmp_path, modes):
    out = tmp_path / f"tp{nproc}.jsonl"
    torchrun("tutorial_utils.workers.tp_check",
             ["--out", str(out), "--device", "cpu", "--modes", *modes], nproc=nproc,
             timeout_s=180, echo=False)
    return {r["mode"]: r for r in read_jsonl(out)}


@pytest.mark.parametrize("nproc", [2, 4])
def test_every_split_equals_one_process(nproc, tmp_path):
    modes = ["by-hand", "parallelize_module", "sequence-parallel"] + (["2-D"] if nproc == 4
                                                                      else [])
    rows = _check(nproc, tmp_path, modes)
    assert sorted(rows) == sorted(modes)
    for r in rows.values():
        assert r["loss_diff"] < 1e-5 and r["grad_diff"] < 1e-5, r
        assert r["params_per_rank"] < r["params_total"]
    # the DTensor route splits the output layer too; the 2-D mesh shards the rest over dp
    assert rows["parallelize_module"]["params_per_rank"] < rows["by-hand"]["params_per_rank"]
    if nproc == 4:
        assert rows["2-D"]["params_per_rank"] < rows["parallelize_module"]["params_per_rank"]


def test_a_dropped_collective_is_caught(tmp_path):
    out = tmp_path / "dropped.jsonl"
    torchrun(str(Path(__file__).parent / "workers" / "tp_dropped.py"), [str(out)], nproc=4,
             timeout_s=180, echo=False)
    rows = read_jsonl(out)
    assert len(rows) == 4
    for r in rows:
        assert r["grad_diff"] > 1e-4, r


def test_the_check_outside_torchrun_is_one_line():
    done = subprocess.run([sys.executable, "-m", "tutorial_utils.workers.tp_check"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == ("python -m tutorial_utils.workers.tp_check: error: run it "
                                   "under torchrun with 2 or more processes")


def test_the_2d_check_on_a_process_count_it_cannot_split_is_one_line():
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    done = subprocess.run([sys.executable, "-m", "tutorial_utils.workers.tp_check", "--modes",
                           "2-D"], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 2
    assert done.stderr.strip() == ("python -m tutorial_utils.workers.tp_check: error: run it "
                                   "under torchrun with 2 or more processes")


def test_the_n_gpu_worker_times_every_mode_on_cpu_processes(tmp_path):
    out = tmp_path / "steps.jsonl"
    torchrun("tutorial_utils.bench.workers.tp_step",
             ["--out", str(out), "--device", "cpu", "--dim", "32", "--layers", "1", "--heads",
              "4", "--seq", "16", "--batch", "4", "--repeats", "1"], nproc=2, timeout_s=180,
             echo=False)
    rows = read_jsonl(out)
    assert [r["mode"] for r in rows] == ["fsdp", "tp", "tp+sp"]  # 2-D needs 4 processes
    assert all(r["step_ms"] > 0 and r["world_size"] == 2 for r in rows)


@pytest.mark.parametrize(("args", "message"), [
    (["--dim", "30", "--heads", "4"], "dim=30 must be a multiple of heads=4"),
    (["--batches"], "--batches: give sizes >= 1"),
    (["--lr", "nan"], "--lr must be a number > 0, got nan"),
    (["--gpus", "1"], "--gpus must be 0 or >= 2, got 1"),
    (["--record"], "--record measures the GPT on one GPU, and this machine has none"),
    (["--gpus", "64", "--record"], "--gpus 64: asked for 64 GPU(s) but this machine has"),
])
def test_the_benchmark_refuses_bad_settings_in_one_line(args, message):
    done = subprocess.run([sys.executable, "-m", "tutorial_utils.bench.transformer", *args],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert message in done.stderr


@pytest.mark.gpu
def test_checkpointing_lowers_the_peak_memory_on_a_gpu():
    from tutorial_utils.bench import transformer

    cfg = transformer.TransformerConfig(dim=256, layers=4, heads=4, seq=512, batches=(16,),
                                        repeats=2, device="cuda")
    plain, recomputed = transformer.step_rows(cfg)
    assert not plain.checkpointing and recomputed.checkpointing
    assert recomputed.peak_gib < 0.8 * plain.peak_gib
    assert recomputed.step_ms > plain.step_ms > 0


@pytest.mark.multigpu
def test_every_split_equals_one_process_on_two_gpus(tmp_path):
    out = tmp_path / "tp.jsonl"
    torchrun("tutorial_utils.workers.tp_check", ["--out", str(out), "--device", "cuda"],
             nproc=2, timeout_s=300, echo=False)
    rows = read_jsonl(out)
    assert len(rows) == 3 and all(r["grad_diff"] < 1e-4 for r in rows), rows


def test_each_pair_runs_one_all_reduce_each_way(tmp_path):
    out = tmp_path / "counts.jsonl"
    torchrun(str(Path(__file__).parent / "workers" / "tp_count.py"), [str(out)], nproc=2,
             timeout_s=180, echo=False)
    hand, dtensor = read_jsonl(out)
    layers = hand["layers"]
    assert (hand["forward"], hand["backward"]) == (2 * layers, 2 * layers)  # g, then f
    # the output layer, split by vocabulary, adds one in backward (its input's gradient)
    assert (dtensor["forward"], dtensor["backward"]) == (2 * layers, 2 * layers + 1)
