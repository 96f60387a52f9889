"""Dated records: written with their command, stamp and module hashes, read back, never stale
in silence; the chapters read the book's own records without measuring."""

import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from tutorial_utils.bench import records
from tutorial_utils.config import Config, opt

BOOK_DATA = Path(__file__).resolve().parents[1] / "book" / "data"


@dataclass
class TinyConfig(Config):
    """A measurement with one setting."""

    size: int = opt(1, "how big")


def test_a_record_keeps_its_command_stamp_and_modules(tmp_path):
    path = records.write("tiny", TinyConfig(size=3), [{"x": 1.5}, {"x": 2.5}],
                         "tutorial_utils.bench.tiny", ["tutorial_utils.toy"], root=tmp_path)
    record = records.load("tiny", root=tmp_path)
    assert path == tmp_path / "tiny.jsonl" and record.rows == [{"x": 1.5}, {"x": 2.5}]
    head = record.header
    assert head["command"] == "python -m tutorial_utils.bench.tiny --size 3"
    assert head["config"] == {"size": 3} and head["stamp"]["torch"]
    assert "tutorial_utils.toy" in head["modules"]  # a launched worker is hashed too
    assert record.changed_modules() == []
    text = record.describe()
    assert "Record tiny: measured on" in text and "0 of" in text and "Remade by: python -m" in text


def test_a_changed_or_vanished_module_is_named(tmp_path):
    records.write("tiny", TinyConfig(), [], "x", ["tutorial_utils.toy"], root=tmp_path)
    path = tmp_path / "tiny.jsonl"
    head, *rows = [json.loads(line) for line in path.read_text().splitlines()]
    head["modules"] |= {"tutorial_utils.toy": "0" * 64, "tutorial_utils.gone": "1" * 64}
    path.write_text("".join(json.dumps(r) + "\n" for r in [head, *rows]))
    record = records.load("tiny", root=tmp_path)
    assert set(record.changed_modules()) == {"tutorial_utils.toy", "tutorial_utils.gone"}
    assert "toy" in record.describe() and "gone" in record.describe()


def test_without_a_record_the_measurement_runs_here_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(records, "ROOT", tmp_path)
    calls = []
    rows, source = records.read_or_measure("absent", lambda: calls.append(1) or [{"y": 1}],
                                           TinyConfig())
    assert rows == [{"y": 1}] and calls == [1]
    assert source.text.startswith("No record absent yet: measured here")
    assert source.config == {"size": 1} and source.made.startswith("this machine")
    records.write("present", TinyConfig(), [{"y": 2}], "x", root=tmp_path)
    rows, source = records.read_or_measure("present", lambda: pytest.fail("measured"))
    assert rows == [{"y": 2}] and source.made.startswith("a record made on")


def test_a_sweep_made_in_parts_is_one_record_in_the_plans_order(tmp_path):
    order = ["a", "b", "c"]
    part = [{"run": "c", "x": 3}]
    path, kept = records.write_part("sweep", TinyConfig(), part, order, "x", root=tmp_path)
    assert kept == 0 and records.load("sweep", root=tmp_path).rows == part
    rest = [{"run": "a", "x": 1}, {"run": "b", "x": 2}, {"run": "b", "x": 2.5}]
    _, kept = records.write_part("sweep", TinyConfig(), rest, order, "x", root=tmp_path)
    assert kept == 1
    assert [r["x"] for r in records.load("sweep", root=tmp_path).rows] == [1, 2, 2.5, 3]
    # made again with another configuration: the earlier runs do not belong to it
    _, kept = records.write_part("sweep", TinyConfig(size=2), part, order, "x", root=tmp_path)
    assert kept == 0 and records.load("sweep", root=tmp_path).rows == part


def _part(run, root):
    """Write run ``run`` of the two-run sweep ("a", "b") as a part; how many runs it kept."""
    return records.write_part("sweep", TinyConfig(), [{"run": run}], ["a", "b"], "x",
                              root=root)[1]


def test_a_part_measured_with_other_code_replaces_the_record(tmp_path):
    _part("a", tmp_path)
    path = tmp_path / "sweep.jsonl"
    head, *rows = [json.loads(line) for line in path.read_text().splitlines()]
    head["modules"] = {m: "0" * 64 for m in head["modules"]}  # as if the code had changed
    path.write_text("".join(json.dumps(r) + "\n" for r in [head, *rows]))
    kept = _part("b", tmp_path)
    assert kept == 0 and records.load("sweep", root=tmp_path).rows == [{"run": "b"}]


def test_a_part_made_at_another_commit_replaces_the_record(tmp_path, monkeypatch):
    monkeypatch.setenv("TUTORIAL_GIT_COMMIT", "aaaaaaaaaaaa")
    _part("a", tmp_path)
    monkeypatch.setenv("TUTORIAL_GIT_COMMIT", "bbbbbbbbbbbb")
    kept = _part("b", tmp_path)
    record = records.load("sweep", root=tmp_path)
    assert kept == 0 and record.rows == [{"run": "b"}]
    assert record.header["stamp"]["git_commit"] == "bbbbbbbbbbbb"


@pytest.mark.parametrize(("only", "error"), [("x", "run positions such as"), ("0-9", "0 to 5"),
                                             ("-1", "run positions such as")])
def test_a_bad_part_of_a_sweep_is_one_line(only, error):
    from tutorial_utils.bench.experiment import positions
    from tutorial_utils.config import ConfigError

    assert positions("0,2-3", 6) == [0, 2, 3]
    with pytest.raises(ConfigError, match=error):
        positions(only, 6)


@pytest.mark.parametrize("name", sorted(p.stem for p in BOOK_DATA.glob("*.jsonl")))
def test_the_books_records_are_dated_and_hold_no_machine_paths(name):
    record = records.load(name)
    stamp = record.header["stamp"]
    assert stamp["gpu_count"] >= 1 and stamp["date_utc"] and stamp["git_commit"]
    assert record.header["command"].startswith("python -m tutorial_utils.bench.")
    assert record.rows and record.describe()
    text = (BOOK_DATA / f"{name}.jsonl").read_text()
    assert not re.search(r'"/(home|root|work|tmp|Users|data)/', text), "a machine's path"


def test_the_chapters_read_their_records_without_measuring(monkeypatch):
    from tutorial_utils.bench import data_parallel, experiment, model_parallel, scaling

    for module in (data_parallel, model_parallel, scaling):
        monkeypatch.setattr(module, "run", lambda *a: pytest.fail("measured, not read"))
    monkeypatch.setattr(experiment, "run_jobs", lambda *a: pytest.fail("trained, not read"))
    rows, ddp, source = data_parallel.measured(data_parallel.DataParallelConfig())
    assert source.hardware == "2 x NVIDIA H200" and ddp["world_size"] == 2
    assert data_parallel.summary(rows, ddp, data_parallel.DataParallelConfig())["ddp_x"] > 1
    rows, _, _ = model_parallel.measured(model_parallel.ModelParallelConfig())
    assert model_parallel.summary(rows)["best_m"] >= 1
    runs, _ = scaling.measured(scaling.ScalingConfig())
    assert scaling.summary(runs, 128)["weak_2_x"] > 1
    runs, _ = experiment.measured("05", experiment.plan(1, "full"), "auto")
    assert [r.processes for r in runs] == [1, 2, 2] and all(len(r.epochs) == 10 for r in runs)
