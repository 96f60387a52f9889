"""MFU: the peaks by GPU name and their sources, the arithmetic, the model FLOPs of the WRN and
the GPT, and the chapters' tables of the book's records with their MFU, each within 100
characters."""

import re
from pathlib import Path

import pytest
import torch

from tutorial_utils.bench import mfu, records
from tutorial_utils.models.gpt import GPT, GPTConfig, flops_per_token

BIB = Path(__file__).resolve().parents[1] / "book" / "references.bib"
H200 = "NVIDIA H200"


@pytest.mark.parametrize(("name", "tflops", "cite"), [
    ("NVIDIA H100 80GB HBM3", 989.5, "nvidia_h100"),  # H100 SXM: 1,979 with sparsity
    ("NVIDIA H100 PCIe", 756.5, "nvidia_h100"),
    ("NVIDIA H100 NVL", 835.5, "nvidia_h100"),
    ("NVIDIA H200", 989.5, "nvidia_h200"),
    ("NVIDIA H200 NVL", 835.5, "nvidia_h200"),  # not the SXM's
    ("NVIDIA A100-SXM4-40GB", 312, "nvidia_a100"),
    ("NVIDIA A100 80GB PCIe", 312, "nvidia_a100"),
    ("NVIDIA L4", 121, "nvidia_l4"),
    ("NVIDIA L40S", 362.05, "nvidia_l40s"),
    ("nvidia  geforce rtx 4090", 165.2, "nvidia_ada"),  # case and spaces do not matter
])
def test_known_gpus_map_to_their_cited_dense_bf16_peak(name, tflops, cite):
    peak = mfu.peak_of(name)
    assert peak.tflops == tflops and peak.cite == cite and peak.flops == tflops * 1e12


@pytest.mark.parametrize("name", ["NVIDIA GeForce GTX 1080", "AMD Instinct MI300X", "NVIDIA H",
                                  "", None])
def test_an_unknown_gpu_or_none_has_no_peak_and_no_mfu(name):
    assert mfu.peak_of(name) is None
    assert mfu.mfu(1e12, 10.0, name) is None and mfu.of_rate(1e14, name) is None


def test_every_peak_is_what_its_cited_source_prints_and_the_source_is_in_the_bibliography():
    keys = set(re.findall(r"@\w+\{(\w+),", BIB.read_text()))
    for p in mfu.PEAKS:
        assert p.cite in keys and p.cite in mfu.SOURCES
        printed = float(re.search(r"([\d,]+(?:\.\d+)?) TFLOPS", p.printed)[1].replace(",", ""))
        # a datasheet that prints the rate with sparsity halves it; one that prints both, dense
        dense = printed / 2 if "dense is half" in p.printed else printed
        assert dense == p.tflops, p.gpu
        assert "with sparsity" in p.printed  # each says which figure is the sparse one


def test_mfu_is_model_flops_per_second_and_gpu_over_the_peak():
    step = 989.5e12 * 0.010  # a step that keeps one H200 at its peak for 10 ms
    assert mfu.mfu(step, 10.0, H200) == pytest.approx(1.0)
    assert mfu.mfu(step, 20.0, H200) == pytest.approx(0.5)
    assert mfu.mfu(step, 10.0, H200, gpus=2) == pytest.approx(0.5)  # the same work on two
    assert mfu.of_rate(312e12 / 4, "NVIDIA A100-SXM4-80GB") == pytest.approx(0.25)
    assert mfu.mfu(step, None, H200) is None and mfu.mfu(step, float("nan"), H200) is None


def test_the_gpu_that_measured_comes_from_a_stamp_or_a_source_and_cpus_have_none():
    from tutorial_utils.stamp import environment_stamp

    source = records.Source("", "", {}, "", stamp={"gpu_names": [H200, H200]})
    assert mfu.gpu_of(source) == H200 and mfu.gpu_of({"gpu_names": ["NVIDIA L4"]}) == "NVIDIA L4"
    assert mfu.gpu_of({"gpu_names": []}) is None  # a CPU-only machine's stamp
    assert mfu.gpu_of(records.Source("", "", {}, "")) is None  # a stand-in: CPU processes
    assert mfu.gpu_of(None) is None
    here = environment_stamp()
    assert mfu.gpu_of(here) == (here.gpu_names[0] if here.gpu_count else None)


def test_the_wrn_flop_count_scales_with_the_batch_and_is_what_a_real_step_runs():
    from torch.utils.flop_counter import FlopCounterMode

    from tutorial_utils.bench.workload import LADDER, Workload, make_train_step

    one, four = mfu.wrn_step_flops("wrn-10-1", 1), mfu.wrn_step_flops("wrn-10-1", 4)
    assert one > 0 and four == pytest.approx(4 * one, rel=1e-9)
    assert mfu.wrn_step_flops("wrn-28-10", 128) == pytest.approx(
        128 * mfu.wrn_step_flops("wrn-28-10", 1), rel=1e-9)
    step = make_train_step(LADDER[0], Workload("wrn-10-1", 4, 0, 1), torch.device("cpu"))
    with FlopCounterMode(display=False) as counter:
        step()
    assert counter.get_total_flops() == four, "the meta count is the real step's"


def test_the_gpt_flops_per_step_are_6_per_parameter_and_token_plus_attention():
    cfg = GPTConfig(seq=32, layers=2, heads=2, dim=32)
    n = sum(p.numel() for p in GPT(cfg).parameters())
    assert mfu.gpt_step_flops(cfg, 3) == flops_per_token(cfg, n) * 3 * 32
    assert mfu.gpt_step_flops(cfg, 6, n) == 2 * mfu.gpt_step_flops(cfg, 3)
    assert flops_per_token(cfg, n) == 6 * n + 12 * 2 * 32 * 32
    # with experts a token uses top_k of each block's expert MLPs, and the router: top_k=1 is
    # the dense model's parameters plus the routers'
    moe = GPTConfig(seq=32, layers=2, heads=2, dim=32, experts=4, top_k=1)
    assert mfu.gpt_step_flops(moe, 3) == flops_per_token(moe, n + 2 * 32 * 4) * 3 * 32


def table_rows(text: str) -> list[str]:
    """A table's lines, header first, without the note under it ("MFU...", indented)."""
    lines = text.splitlines()
    return lines[:next((i for i, line in enumerate(lines) if line.startswith("MFU")),
                       len(lines))]


def _widths_and_mfus(text: str) -> tuple[int, list[str]]:
    """The widest line of a table and its note, and the MFU cells that hold a percentage."""
    head, *rows = table_rows(text)
    end = head.index(" MFU") + 4  # the column is right-aligned under its header
    cells = [row[end - mfu.COLUMN.width:end].strip() for row in rows]
    return max(map(len, text.splitlines())), [c for c in cells if re.fullmatch(r"\d+\.\d%", c)]


def test_chapter_2s_ladder_gives_each_rung_its_mfu_on_the_records_gpu():
    from tutorial_utils.bench import one_gpu
    from tutorial_utils.bench.workload import RungResult

    rec = records.load("02-ladder")
    rungs, gpu = rec.typed(RungResult), rec.header["stamp"]["gpu_names"][0]
    flops = mfu.wrn_step_flops(rec.header["config"]["model"], rec.header["config"]["batch"])
    width, shares = _widths_and_mfus(one_gpu.ladder_table(rungs, flops, gpu))
    assert width <= 100 and len(shares) == len(rungs)
    summary = one_gpu.ladder_summary(rungs, flops, gpu)
    graphs = rungs[-1]
    assert summary["ladder_graphs_mfu"] == pytest.approx(
        100 * flops / (graphs.ms / 1e3) / mfu.peak_of(gpu).flops)
    assert summary["mfu_gpu"] == mfu.peak_of(gpu).gpu and 0 < summary["ladder_graphs_mfu"] < 100
    cpu = one_gpu.ladder_table(rungs, flops, None)  # no GPU: no MFU, "-"
    assert not _widths_and_mfus(cpu)[1] and "not measured on a GPU" in cpu


def test_chapter_4s_and_5bs_tables_give_mfu_within_100_characters():
    from tutorial_utils.bench import data_parallel, scaling

    rows, ddp, source = data_parallel.measured(data_parallel.DataParallelConfig())
    gpu = mfu.gpu_of(source)
    width, shares = _widths_and_mfus(data_parallel.table_of(rows, "wrn-28-10", gpu))
    assert width <= 100 and len(shares) == sum(r.step_ms is not None for r in rows)
    out = data_parallel.summary(rows, ddp, data_parallel.DataParallelConfig(), gpu)
    assert 0 < out["ddp_mfu"] < 100 and 0 < out["best_single_mfu"] < 100
    runs, source = scaling.measured(scaling.ScalingConfig())
    width, shares = _widths_and_mfus(scaling.table_of(runs, "wrn-28-10", mfu.gpu_of(source)))
    assert width <= 100 and len(shares) == len(runs)
    out = scaling.summary(runs, 128, "wrn-28-10", mfu.gpu_of(source))
    assert all(0 < out[k] < 100 for k in ("single_ref_mfu", "strong_2_mfu", "weak_2_mfu"))


def test_chapter_5s_runs_6s_sharding_and_7s_steps_give_mfu_within_100_characters():
    from tutorial_utils.bench import experiment, sharding, transformer

    runs, _ = experiment.measured("05", experiment.plan(1, "full"), "auto")
    width, shares = _widths_and_mfus(experiment.runs_table(runs, runs[0]))
    assert width <= 100 and len(shares) == len(runs)
    rows, source = sharding.measured(sharding.ShardingConfig(nproc=1))
    for batch in sharding.batches(rows):
        width, shares = _widths_and_mfus(sharding.time_table(rows, batch, mfu.gpu_of(source)))
        assert width <= 100 and len(shares) == len(sharding._modes(rows, batch))
    steps, _, source = transformer.one_gpu(transformer.TransformerConfig())
    text = transformer.step_table(steps, transformer.TransformerConfig().model, mfu.gpu_of(source))
    width, shares = _widths_and_mfus(text)
    assert width <= 100 and len(shares) == sum(not r.oom for r in steps)
    # MFU counts model FLOPs: the checkpointed step recomputes more, and is credited the same
    plain, ckpt = (next(r for r in steps if r.batch == 32 and r.checkpointing is c)
                   for c in (False, True))
    assert plain.tflops * plain.step_ms == pytest.approx(ckpt.tflops * ckpt.step_ms, rel=1e-6)


def test_chapter_7s_n_gpu_table_divides_by_every_gpu():
    from tutorial_utils.bench import transformer

    cfg = GPTConfig(seq=1024, layers=12, heads=12, dim=768)
    flops = mfu.gpt_step_flops(cfg, 32)
    rows = [{"mode": "fsdp", "world_size": 2, "mesh": "dp 2", "batch": 32, "step_ms": 100.0,
             "tokens_per_s": 32 * 1024 / 0.1, "peak_gib": 10.0}]
    text = transformer.n_gpu_table(rows, cfg, H200)
    share = flops / 0.1 / 2 / 989.5e12
    assert f"{share:.1%}" in text and max(map(len, text.splitlines())) <= 100


def test_the_peaks_table_names_the_records_made_on_each_gpu():
    text = mfu.peaks_table({H200: ["04-data-parallel"], "NVIDIA H100 80GB HBM3": ["02-ladder"]})
    h200 = next(line for line in text.splitlines() if line.startswith("| H200 SXM"))
    assert "`04-data-parallel`" in h200 and "989.5" in h200
    assert len(text.splitlines()) == 2 + len(mfu.PEAKS)


def test_chapter_8s_context_parallel_table_divides_causal_attention_by_every_rank():
    from tutorial_utils.bench import context
    from tutorial_utils.bench.workers.cp_step import CPStepRow

    step = context.ContextConfig(gpus=2, seqs=(8192,), batch=1, heads=16, head_dim=128)
    flops = mfu.causal_attention_flops(1, 16, 8192, 128)
    assert flops == 6 * 16 * 8192**2 * 128  # forward 2 b h s^2 d under the mask, backward twice
    rows = [CPStepRow("one-process", 1, 8192, step_ms=10.0), CPStepRow("ring", 2, 8192, 10.0)]
    text = context.step_table(rows, step, H200)
    one, two = flops / 0.01 / 989.5e12, flops / 0.01 / 2 / 989.5e12
    assert f"{one:.1%}" in text and f"{two:.1%}" in text
    assert max(map(len, text.splitlines())) <= 100
    assert "not measured on a GPU" in context.step_table(rows, step, None)  # CPU processes
