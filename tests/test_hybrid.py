"""Chapter 8: the GPT on a 3-D and a 4-D mesh (data x pipeline x context x tensor) against one
process.

Eight gloo processes, twice: dp 2 x pp 2 x tp 2 (3-D; the context dimension of size 1), and
dp 1 x pp 2 x cp 2 x tp 2 (4-D with context: every dimension but dp splits something; the cp
ranks take zig-zag slices of every sequence, their attention a ring). Tolerances: the same
values summed in another order in float32 (micro-batches, tensor-parallel partial sums, the
online softmax of the ring, the mean over dp x cp); the loss over three AdamW steps to 1e-5,
the first step's gradients to 1e-6 (measured: 5e-7 and 4e-8 on both meshes).
"""

import os
import subprocess
import sys

import pytest

from tutorial_utils.config import ConfigError
from tutorial_utils.launch import torchrun
from tutorial_utils.models.gpt import GPTConfig
from tutorial_utils.parallel import planner
from tutorial_utils.parallel.hybrid import MeshShape, check_mesh

SMALL = GPTConfig(seq=16, layers=2, heads=2, dim=32)


@pytest.mark.parametrize("shape", [MeshShape(dp=2, pp=2, tp=2), MeshShape(cp=2, pp=2, tp=2)],
                         ids=["3d-dp2-pp2-tp2", "4d-pp2-cp2-tp2"])
def test_a_gpt_on_a_mesh_of_8_processes_trains_like_one_process(shape, tmp_path):
    out = tmp_path / "hybrid.jsonl"
    sizes = {d: getattr(shape, d) for d in ("dp", "pp", "cp", "tp")}
    (row,) = torchrun("tutorial_utils.workers.hybrid_check",
                      [*(a for d, n in sizes.items() for a in (f"--{d}", str(n))), "--device",
                       "cpu", "--repeats", "2", "--out", str(out)], nproc=8, timeout_s=240,
                      metrics_file=out, echo=False).metrics
    assert row["mesh"] == sizes and row["steps"] == 3
    assert row["loss_diff"] < 1e-5 and row["grad_diff"] < 1e-6, row
    assert row["losses"][0] != row["losses"][-1]  # it trained
    # What each process holds is the planner's prediction, exactly: its stage's parameters,
    # split over tp and sharded over dp x cp (2 ranks on both meshes), 4 bytes each for the
    # weights and the gradients and 8 for AdamW's two moments. Ranks are ordered dp, pp, cp,
    # tp: the pp stage is rank // (cp x tp) % pp.
    model = planner.ModelShape.of(SMALL, batch=8)
    layout = planner.Layout(dp=shape.dp, tp=shape.tp, pp=shape.pp, cp=shape.cp,
                            micro_batch=8 // shape.dp // 2, zero="ZeRO-3")
    for rank in range(8):
        stage = rank // (shape.cp * shape.tp) % shape.pp
        n = planner.params_per_gpu(model, layout, stage) // (shape.dp * shape.cp)
        assert row["params_per_rank"][rank] == n
        assert (row["param_bytes"][rank], row["grad_bytes"][rank],
                row["optimizer_bytes"][rank]) == (4 * n, 4 * n, 8 * n)
    predicted = planner.memory(model, layout, planner.Recipe("adam", "fp32"))
    assert max(row["param_bytes"]) == predicted.parameters
    assert max(row["optimizer_bytes"]) == predicted.optimizer
    # its step time, beside the planner's prediction (the numbers are not checked: CPU)
    from tutorial_utils.bench.planner_check import from_hybrid
    from tutorial_utils.workers.hybrid_check import HybridConfig, HybridRow

    measurement = from_hybrid(HybridRow(**row), HybridConfig(**sizes))
    assert measurement.layout == layout and measurement.measured_ms == row["step_ms"] > 0


@pytest.mark.parametrize(("shape", "world", "message"), [
    (MeshShape(dp=2, pp=2), 8, "the mesh dp2 x pp2 x cp1 x tp1 holds 4 processes, not the 8 "
                               "launched"),
    (MeshShape(tp=4), 4, "2 heads do not split over tp=4"),
    (MeshShape(pp=4), 4, "pp=4 stages for 2 blocks: more stages than blocks"),
    (MeshShape(cp=3), 3, "a sequence of 16 tokens cannot be split by a ring of cp=3: the "
                         "zig-zag split needs a multiple of 2 x cp = 6"),
    (MeshShape(dp=3), 3, "batch of 8 sequences does not split over dp=3"),
])
def test_nonsense_meshes_end_in_one_line(shape, world, message):
    with pytest.raises(ConfigError, match=message):
        check_mesh(shape, world, SMALL, batch=8, micro_batches=2)


def test_zbv_under_fsdp2_is_refused_in_one_line():
    four = GPTConfig(seq=16, layers=4, heads=2, dim=32)  # ZB-V: 2 stages a process
    with pytest.raises(ConfigError, match="ZB-V does not run with FSDP2 .dp x cp = 2."):
        check_mesh(MeshShape(dp=2, pp=2), 4, four, batch=8, micro_batches=4, schedule="zbv")
    check_mesh(MeshShape(pp=2, tp=2), 4, four, batch=8, micro_batches=4, schedule="zbv")


def test_the_worker_refuses_a_ring_that_cannot_split_the_sequence_before_any_work():
    done = subprocess.run([sys.executable, "-m", "tutorial_utils.workers.hybrid_check", "--dp",
                           "1", "--cp", "4", "--pp", "2", "--tp", "1", "--seq", "12"],
                          env={**os.environ, "WORLD_SIZE": "8"},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "python -m tutorial_utils.workers.hybrid_check: error: a sequence of 12 tokens cannot "
        "be split by a ring of cp=4: the zig-zag split needs a multiple of 2 x cp = 8"]
