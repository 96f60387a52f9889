"""JSON lines: records that survive a crash of the machine, not only of the writer."""

import os

from tutorial_utils import jsonl
from tutorial_utils.jsonl import read_jsonl, rewrite_jsonl, write_jsonl


def record_syncs(monkeypatch):
    """The (call, inode) of every fsync and rename jsonl makes, in order."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.fstat(fd).st_ino))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.stat(src).st_ino))
        real_replace(src, dst)

    monkeypatch.setattr(jsonl.os, "fsync", fsync)
    monkeypatch.setattr(jsonl.os, "replace", replace)
    return events


def test_a_rewrite_fsyncs_the_folder_after_the_rename(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    write_jsonl(path, [{"epoch": 1}, {"epoch": 2}])
    events = record_syncs(monkeypatch)
    rewrite_jsonl(path, [{"epoch": 1}])
    file, folder = path.stat().st_ino, tmp_path.stat().st_ino
    # the rename is an entry in the folder: a crash before the folder reaches the disk could
    # bring the old file back, with records of epochs the checkpoint no longer holds
    assert events == [("fsync", file), ("replace", file), ("fsync", folder)]
    assert read_jsonl(path) == [{"epoch": 1}]


def test_a_new_file_and_its_folder_entry_reach_the_disk(tmp_path, monkeypatch):
    path = tmp_path / "run" / "metrics.jsonl"
    events = record_syncs(monkeypatch)
    write_jsonl(path, [{"event": "start"}])
    assert events == [("fsync", path.stat().st_ino), ("fsync", path.parent.stat().st_ino)]
    events.clear()
    write_jsonl(path, [{"event": "epoch"}])  # an append: the folder entry exists already
    assert events == [("fsync", path.stat().st_ino)]
    assert read_jsonl(path) == [{"event": "start"}, {"event": "epoch"}]
