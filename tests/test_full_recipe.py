"""Chapter 5's 200-epoch run, kept as a record: one whole run of the command its page prints."""

import json
import math
import re
import shlex
from itertools import pairwise
from pathlib import Path

from tutorial_utils.bench import records
from tutorial_utils.bench.experiment import from_rows
from tutorial_utils.config import parse, to_dict
from tutorial_utils.trainer import TrainConfig, saved_train_config

ROOT = Path(__file__).resolve().parents[1]
CHAPTER = ROOT / "notebooks/05_wrn_experiment.ipynb"
RECIPE = ("depth", "width", "dropout", "epochs", "batch", "scaling", "lr", "schedule",
          "warmup_epochs", "weight_decay", "label_smoothing", "crop_pad", "tta", "precision",
          "compile", "step_graph", "loader", "checkpoint_every", "seed")


def printed_command() -> TrainConfig:
    """The configuration of the full-recipe command in the chapter's bash block."""
    cells = json.loads(CHAPTER.read_text())["cells"]
    text = next("".join(c["source"]) for c in cells
                if c["cell_type"] == "markdown" and "## The full recipe" in "".join(c["source"]))
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1).replace("\\\n", " ")
    argv = shlex.split(block)
    return parse(TrainConfig, argv[argv.index("tutorial_utils.train") + 1:], "train", "")


def stored_run():
    (run,) = from_rows(records.load("05-wrn-200ep").rows)
    return run


def test_the_stored_run_is_the_printed_command():
    run, printed = stored_run(), to_dict(printed_command())
    for start in [run.start, *run.resumes]:  # every job ran the same recipe
        saved = saved_train_config(start["config"])  # recorded when the option was --bf16
        assert {k: saved[k] for k in RECIPE} == {k: printed[k] for k in RECIPE}
    assert run.start["data"].startswith("CIFAR-10") and not run.start["synthetic_data"]
    assert run.start["stamp"]["gpu_count"] >= 1  # made on a GPU, not a CPU smoke run


def test_the_jobs_add_up_to_one_whole_run():
    run = stored_run()
    assert [e["epoch"] for e in run.epochs] == list(range(1, 201))  # no gap, no repeat
    assert run.resumes, "stored as one job: the resume path was not used"
    for start in run.resumes:  # each job resumed from a checkpoint (every 5 epochs)
        assert start["start_epoch"] % start["config"]["checkpoint_every"] == 0
    # the training clock carried over the resumes: it is the sum of the epochs' times
    assert math.isclose(run.epochs[-1]["train_time_s"], run.train_s, rel_tol=1e-9)
    drops = [b["epoch"] for a, b in pairwise(run.epochs) if b["lr"] < a["lr"]]
    assert drops == [60, 120, 160]  # the paper's step schedule
