"""Dated records: written atomically with their command, stamp and module hashes, refused when
torn or made on less hardware than they name, read back, never stale in silence; the chapters
read the book's own records, or measure this machine when asked to (TUTORIAL_MEASURE=1)."""

import dataclasses
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
                         "tutorial_utils.bench.tiny", ["tutorial_utils.toy"], root=tmp_path, gpus=0)
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
    records.write("tiny", TinyConfig(), [], "x", ["tutorial_utils.toy"], root=tmp_path, gpus=0)
    path = tmp_path / "tiny.jsonl"
    head, *rows = [json.loads(line) for line in path.read_text().splitlines()]
    head["modules"] |= {"tutorial_utils.toy": "0" * 64, "tutorial_utils.gone": "1" * 64}
    path.write_text("".join(json.dumps(r) + "\n" for r in [head, *rows]))
    record = records.load("tiny", root=tmp_path)
    assert set(record.changed_modules()) == {"tutorial_utils.toy", "tutorial_utils.gone"}
    assert "toy" in record.describe() and "gone" in record.describe()


def _write(root, rows, gpus=0, name="tiny"):
    return records.write(name, TinyConfig(), rows, "tutorial_utils.bench.tiny", root=root,
                         gpus=gpus, what="a tiny measurement")


def test_a_write_that_fails_leaves_the_old_record_whole(tmp_path, monkeypatch):
    _write(tmp_path, [{"x": i} for i in range(66)])
    before = (tmp_path / "tiny.jsonl").read_bytes()

    class Unwritable:  # a row that fails half-way through the new file
        def __iter__(self):
            raise OSError("disk full")

    monkeypatch.setattr(records, "as_row", lambda r: r if r != "bad" else Unwritable())
    with pytest.raises(Exception):  # noqa: B017 - whatever the failure, the file stays
        _write(tmp_path, [{"x": 1}, "bad"])
    assert (tmp_path / "tiny.jsonl").read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["tiny.jsonl"], "no temporary file left"


def test_a_torn_record_is_refused_in_one_line(tmp_path):
    _write(tmp_path, [{"x": i} for i in range(66)])
    path = tmp_path / "tiny.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:33]))  # a copy cut short, at a line's end
    with pytest.raises(records.RecordError, match=r"holds 32 of its 66 rows: it is torn"):
        records.load("tiny", root=tmp_path)
    path.write_text("".join(lines[:10]) + "{\"x\": 1" + "".join(lines[11:]))
    with pytest.raises(records.RecordError, match="damaged; restore it"):
        records.load("tiny", root=tmp_path)


def test_a_record_needs_the_hardware_it_names(tmp_path, monkeypatch):
    from tutorial_utils import stamp

    real = stamp.environment_stamp()
    monkeypatch.setattr(stamp, "environment_stamp",
                        lambda: dataclasses.replace(real, gpu_count=1))
    with pytest.raises(records.RecordError, match="on 2 GPUs; this machine has 1: make it"):
        _write(tmp_path, [{"x": 1}], gpus=2)
    assert not (tmp_path / "tiny.jsonl").exists()
    assert records.load("tiny", root=tmp_path) is None


@dataclass
class Row:
    run: str
    ms: float


def _measuring(monkeypatch, tmp_path, gpus_here, measure_env):
    from tutorial_utils import devices

    monkeypatch.setattr(records, "ROOT", tmp_path)
    monkeypatch.setattr(devices, "gpu_count", lambda: gpus_here)
    if measure_env:
        monkeypatch.setenv(records.MEASURE_ENV, "1")
    else:
        monkeypatch.delenv(records.MEASURE_ENV, raising=False)


COMPARE = records.Compare(("run",), "ms", "run")


def test_a_chapter_reads_its_record_and_never_measures(tmp_path, monkeypatch):
    _measuring(monkeypatch, tmp_path, 0, measure_env=False)
    _write(tmp_path, [Row("a", 1.5)])
    rows, source = records.measured("tiny", lambda: pytest.fail("measured"), gpus=1,
                                    row_type=Row, compare=COMPARE)
    assert rows == [Row("a", 1.5)] and not source.here
    assert source.text.startswith("Record tiny: measured on") and "TUTORIAL_MEASURE" not in \
        source.text
    assert source.made.startswith("a record made on CPU only")


def test_a_machine_with_the_gpus_is_told_how_to_measure_itself(tmp_path, monkeypatch):
    _measuring(monkeypatch, tmp_path, 2, measure_env=False)
    _write(tmp_path, [Row("a", 1.5)])
    _, source = records.measured("tiny", lambda: pytest.fail("measured"), gpus=2)
    assert source.text.splitlines()[-1] == ("This machine has 2 GPUs: TUTORIAL_MEASURE=1 "
                                            "measures them instead of reading this record.")


def test_measuring_here_sets_this_machine_beside_the_record(tmp_path, monkeypatch):
    _measuring(monkeypatch, tmp_path, 1, measure_env=True)
    _write(tmp_path, [Row("a", 1.5), Row("b", 3.0)])
    rows, source = records.measured("tiny", lambda: [Row("a", 1.25), Row("c", 9.0)], gpus=1,
                                    cfg=TinyConfig(size=2), row_type=Row, compare=COMPARE)
    assert rows == [Row("a", 1.25), Row("c", 9.0)] and source.here
    text = source.text
    assert text.startswith("Measured here, on") and "Beside it, record tiny" in text
    assert "Its settings differ: size 1 there, 2 here." in text
    table = text.splitlines()[-4:]
    assert "record: CPU only" in table[0] and "this machine:" in table[0]
    assert table[1].split() == ["a", "1.50", "1.25"] and table[2].split() == ["b", "3.00", "-"]
    assert table[3].split() == ["c", "-", "9.00"]


def test_measuring_on_fewer_gpus_than_the_record_needs_reads_the_record(tmp_path, monkeypatch):
    _measuring(monkeypatch, tmp_path, 1, measure_env=True)
    _write(tmp_path, [Row("a", 1.5)])
    rows, source = records.measured("tiny", lambda: pytest.fail("measured"), gpus=2,
                                    row_type=Row)
    assert rows == [Row("a", 1.5)]
    assert "TUTORIAL_MEASURE=1, but this machine has 1 GPU(s) and the measurement needs 2" \
        in source.text


def test_without_a_record_a_stand_in_runs_on_the_cpu_or_the_measurement_is_pending(
        tmp_path, monkeypatch):
    _measuring(monkeypatch, tmp_path, 0, measure_env=False)
    rows, source = records.measured("absent", lambda: pytest.fail("measured"), gpus=2)
    assert rows == [] and source.text.startswith("Pending: no record absent yet;")
    rows, source = records.measured("absent", lambda: pytest.fail("measured"), gpus=2,
                                    stand_in=lambda: [Row("a", 7.0)])
    assert rows == [Row("a", 7.0)] and source.here
    text = source.text.replace("\n", " ")
    assert "measured here instead, in CPU processes" in text and "not a GPU measurement" in text


def test_a_row_of_other_fields_is_refused(tmp_path, monkeypatch):
    _measuring(monkeypatch, tmp_path, 0, measure_env=False)
    _write(tmp_path, [{"run": "a", "ms": 1.0, "seconds": 2}])
    with pytest.raises(records.RecordError, match="is not a Row"):
        records.measured("tiny", list, gpus=1, row_type=Row)


def test_a_sweep_made_in_parts_is_one_record_in_the_plans_order(tmp_path):
    order = ["a", "b", "c"]
    part = [{"run": "c", "x": 3}]
    path, kept = records.write_part("sweep", TinyConfig(), part, order, "x", root=tmp_path,
                                        gpus=0)
    assert kept == 0 and records.load("sweep", root=tmp_path).rows == part
    rest = [{"run": "a", "x": 1}, {"run": "b", "x": 2}, {"run": "b", "x": 2.5}]
    _, kept = records.write_part("sweep", TinyConfig(), rest, order, "x", root=tmp_path,
                                     gpus=0)
    assert kept == 1
    assert [r["x"] for r in records.load("sweep", root=tmp_path).rows] == [1, 2, 2.5, 3]
    # made again with another configuration: the earlier runs do not belong to it
    _, kept = records.write_part("sweep", TinyConfig(size=2), part, order, "x",
                                     root=tmp_path, gpus=0)
    assert kept == 0 and records.load("sweep", root=tmp_path).rows == part


def _part(run, root):
    """Write run ``run`` of the two-run sweep ("a", "b") as a part; how many runs it kept."""
    return records.write_part("sweep", TinyConfig(), [{"run": run}], ["a", "b"], "x",
                              root=root, gpus=0)[1]


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

    monkeypatch.delenv(records.MEASURE_ENV, raising=False)
    for module in (data_parallel, model_parallel, scaling):
        monkeypatch.setattr(module, "run", lambda *a: pytest.fail("measured, not read"))
    monkeypatch.setattr(experiment, "run_jobs", lambda *a: pytest.fail("trained, not read"))
    rows, ddp, source = data_parallel.measured(data_parallel.DataParallelConfig())
    assert source.hardware == "2 x NVIDIA H200" and ddp.world_size == 2
    assert data_parallel.summary(rows, ddp, data_parallel.DataParallelConfig())["ddp_x"] > 1
    rows, _, _ = model_parallel.measured(model_parallel.ModelParallelConfig())
    assert model_parallel.summary(rows)["best_m"] >= 1
    runs, _ = scaling.measured(scaling.ScalingConfig())
    assert scaling.summary(runs, 128)["weak_2_x"] > 1
    runs, _ = experiment.measured("05", experiment.plan(1, "full"), "auto")
    assert [r.processes for r in runs] == [1, 2, 2] and all(len(r.epochs) == 10 for r in runs)


def test_a_run_described_once_is_named_in_one_line_after(tmp_path, monkeypatch):
    _measuring(monkeypatch, tmp_path, 0, measure_env=False)
    monkeypatch.setattr(records, "_DESCRIBED", set())
    _write(tmp_path, [Row("a", 1.0)], name="first")
    _write(tmp_path, [Row("b", 2.0)], name="second")  # the same command, commit and minute
    _, first = records.measured("first", list, gpus=1, row_type=Row)
    _, second = records.measured("second", list, gpus=1, row_type=Row)
    assert "Remade by:" in first.text and "Code changed since: 0 of" in first.text
    assert second.text.startswith("Record second: the same run,") and "Remade" not in second.text
