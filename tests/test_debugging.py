"""The debugging toolbox: DETAIL debugging, stack dumps and flight records on failures made here."""

import pytest

from tutorial_utils.launch import LaunchError, torchrun
from tutorial_utils.workers.mismatch_demo import summary


def _fail(mismatch, env):
    with pytest.raises(LaunchError) as err:
        torchrun("tutorial_utils.workers.mismatch_demo", ["--mismatch", mismatch, "--timeout",
                                                            "10"], nproc=2, timeout_s=120,
                 env=env, echo=False)
    return [s for s in map(summary, err.value.output.splitlines()) if s]


@pytest.mark.parametrize(("mismatch", "expected"), [
    ("shape", {"rank 0 called ALLREDUCE on shape [4], rank 1 ALLREDUCE on shape [8]",
               "rank 1 called ALLREDUCE on shape [8], rank 0 ALLREDUCE on shape [4]"}),
    ("op", {"rank 0 called ALLREDUCE on shape [4], rank 1 BROADCAST on shape [4]",
            "rank 1 called BROADCAST on shape [4], rank 0 ALLREDUCE on shape [4]"}),
])
def test_detail_debugging_names_the_ranks_and_their_collectives(mismatch, expected):
    assert set(_fail(mismatch, {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})) == expected


def test_without_it_the_job_fails_without_saying_why():
    assert _fail("shape", {"TORCH_DISTRIBUTED_DEBUG": "OFF"}) == []


def test_a_stack_dump_of_each_rank_shows_which_one_never_joined():
    import subprocess
    import sys

    from tutorial_utils.debugging import py_spy, stuck_stacks
    from tutorial_utils.launch import kill_tree

    if py_spy() is None:
        pytest.fail("py-spy is a test dependency (requirements.txt)")
    job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            "--nproc_per_node=2", "-m", "tutorial_utils.workers.hang_demo",
                            "--timeout", "60", "--device", "cpu"], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        where = stuck_stacks(job.pid, wait_s=90)  # a slow machine takes a while to start
    except PermissionError as err:  # a container without ptrace: nothing to check
        pytest.skip(str(err))
    finally:
        kill_tree(job, grace_s=2)
    assert sorted(where) == [0, 1], where
    # rank 0 waits inside the collective; rank 1's innermost Python frame is its own code (the
    # line of time.sleep, a C function py-spy does not list): it never called the all-reduce
    assert where[0][0].startswith("all_reduce (") and "hang_demo.py" in where[0][2], where
    assert where[1][0].startswith("main (") and "hang_demo.py" in where[1][0], where


def test_the_flight_records_name_the_rank_that_never_joined(tmp_path):
    from tutorial_utils.debugging import never_joined

    with pytest.raises(LaunchError):
        torchrun("tutorial_utils.workers.hang_demo", ["--timeout", "5", "--device", "cpu",
                                                      "--flight-record", str(tmp_path)],
                 nproc=2, timeout_s=120, env={"TORCH_FR_BUFFER_SIZE": "100"}, echo=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank_0", "rank_1"]
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    report = never_joined(tmp_path)
    assert "Not all ranks joining collective, sequence number: 2" in report, report
    assert "missing ranks: {1}" in report and "hang_demo.py" in report, report
    # the analysis renames and relabels entries in a copy: the reader's records stay as written
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_a_coloured_stack_dump_reads_as_plain_frames(tmp_path, monkeypatch):
    import os

    from tutorial_utils import debugging

    fake = tmp_path / "py-spy"  # a py-spy that colours its output even into a pipe
    fake.write_text("#!/bin/sh\nprintf 'Thread 7 (idle): \"MainThread\"\\n    "
                    "\\033[32mall_reduce\\033[0m (\\033[36mc10d.py\\033[0m:"
                    "\\033[2m30\\033[0m)\\n'\n")
    fake.chmod(0o755)
    monkeypatch.setattr(debugging, "py_spy", lambda: str(fake))
    assert debugging.main_thread(debugging.stack_dump(os.getpid())) == ["all_reduce (c10d.py:30)"]


def test_a_flight_record_needs_the_recorder_on(tmp_path, monkeypatch):
    from tutorial_utils.debugging import never_joined, write_flight_record

    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE", raising=False)
    with pytest.raises(RuntimeError, match="set TORCH_FR_BUFFER_SIZE"):
        write_flight_record(tmp_path, 0)
    with pytest.raises(FileNotFoundError, match="no flight records"):
        never_joined(tmp_path)
