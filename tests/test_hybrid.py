"""Chapter 8: the GPT on a 4-D mesh (data x context x pipeline x tensor) against one process.

Eight gloo processes as dp 2 x cp 1 x pp 2 x tp 2: every dimension but the context one splits
something (the context dimension is there, of size 1: see parallel/hybrid.py). Tolerances: the
same values summed in another order in float32 (micro-batches, tensor-parallel partial sums,
the dp mean); the loss over three AdamW steps to 1e-5, the first step's gradients to 1e-6
(measured: 5e-7 and 4e-8).
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


def test_a_gpt_on_a_4d_mesh_of_8_processes_trains_like_one_process(tmp_path):
    out = tmp_path / "hybrid.jsonl"
    (row,) = torchrun("tutorial_utils.workers.hybrid_check",
                      ["--dp", "2", "--cp", "1", "--pp", "2", "--tp", "2", "--device", "cpu",
                       "--repeats", "2", "--out", str(out)], nproc=8, timeout_s=240,
                      metrics_file=out, echo=False).metrics
    assert row["mesh"] == {"dp": 2, "cp": 1, "pp": 2, "tp": 2} and row["steps"] == 3
    assert row["loss_diff"] < 1e-5 and row["grad_diff"] < 1e-6, row
    assert row["losses"][0] != row["losses"][-1]  # it trained
    # What each process holds is the planner's prediction, exactly: its stage's parameters,
    # split over tp and sharded over dp, 4 bytes each for the weights and the gradients and 8
    # for AdamW's two moments. Ranks are ordered dp, cp, pp, tp: pp stage = (rank // 2) % 2.
    model = planner.ModelShape.of(SMALL, batch=8)
    layout = planner.Layout(dp=2, tp=2, pp=2, micro_batch=2, zero="ZeRO-3")
    for rank in range(8):
        stage = (rank // 2) % 2
        n = planner.params_per_gpu(model, layout, stage) // 2
        assert row["params_per_rank"][rank] == n
        assert (row["param_bytes"][rank], row["grad_bytes"][rank],
                row["optimizer_bytes"][rank]) == (4 * n, 4 * n, 8 * n)
    predicted = planner.memory(model, layout, planner.Recipe("adam", "fp32"))
    assert max(row["param_bytes"]) == predicted.parameters
    assert max(row["optimizer_bytes"]) == predicted.optimizer
    # its step time, beside the planner's prediction (the numbers are not checked: CPU)
    from tutorial_utils.bench.planner_check import from_hybrid
    from tutorial_utils.workers.hybrid_check import HybridConfig, HybridRow

    measurement = from_hybrid(HybridRow(**row), HybridConfig(dp=2, pp=2, tp=2))
    assert measurement.layout == layout and measurement.measured_ms == row["step_ms"] > 0


@pytest.mark.parametrize(("shape", "world", "message"), [
    (MeshShape(2, 1, 2, 1), 8, "holds 4 processes, not the 8 launched"),
    (MeshShape(1, 1, 1, 4), 4, "2 heads do not split over tp=4"),
    (MeshShape(1, 1, 4, 1), 4, "pp=4 stages for 2 blocks: more stages than blocks"),
    (MeshShape(1, 2, 1, 1), 2, "pending"),
    (MeshShape(3, 1, 1, 1), 3, "batch of 8 sequences does not split over dp=3"),
])
def test_nonsense_meshes_end_in_one_line(shape, world, message):
    with pytest.raises(ConfigError, match=message):
        check_mesh(shape, world, SMALL, batch=8, micro_batches=2)
    with pytest.raises(ConfigError, match="cannot be split by a ring of cp=3"):
        check_mesh(MeshShape(1, 3, 1, 1), 3, SMALL, batch=8, micro_batches=2,
                   cp_supported=True)


def test_the_worker_refuses_a_mesh_before_any_work():
    done = subprocess.run([sys.executable, "-m", "tutorial_utils.workers.hybrid_check", "--dp",
                           "2", "--pp", "2", "--tp", "1"], env={**os.environ, "WORLD_SIZE": "8"},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "python -m tutorial_utils.workers.hybrid_check: error: the mesh dp2 x cp1 x pp2 x tp1 "
        "holds 4 processes, not the 8 launched: the product of its sizes must be 8"]
