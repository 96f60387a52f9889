"""JSON lines: records that survive a crash of the machine, not only of the writer."""


from tutorial_utils.jsonl import read_jsonl, rewrite_jsonl, write_jsonl


def test_a_rewrite_fsyncs_the_folder_after_the_rename(tmp_path, syncs):
    path = tmp_path / "metrics.jsonl"
    write_jsonl(path, [{"epoch": 1}, {"epoch": 2}])
    events = syncs
    events.clear()  # the rewrite's own
    rewrite_jsonl(path, [{"epoch": 1}])
    file, folder = path.stat().st_ino, tmp_path.stat().st_ino
    # the rename is an entry in the folder: a crash before the folder reaches the disk could
    # bring the old file back, with records of epochs the checkpoint no longer holds
    assert events == [("fsync", file), ("replace", file), ("fsync", folder)]
    assert read_jsonl(path) == [{"epoch": 1}]


def test_a_new_file_and_its_folder_entry_reach_the_disk(tmp_path, syncs):
    path = tmp_path / "run" / "metrics.jsonl"
    events = syncs
    write_jsonl(path, [{"event": "start"}])
    assert events == [("fsync", path.stat().st_ino), ("fsync", path.parent.stat().st_ino)]
    events.clear()
    write_jsonl(path, [{"event": "epoch"}])  # an append: the folder entry exists already
    assert events == [("fsync", path.stat().st_ino)]
    assert read_jsonl(path) == [{"event": "start"}, {"event": "epoch"}]
