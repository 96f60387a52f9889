import json
import time
from pathlib import Path

import pytest

from tutorial_utils.launch import LaunchError, failure_summary, torchrun

WORKERS = Path(__file__).parent / "workers"


def test_crashing_rank_is_reported_in_one_line_without_waiting_for_the_others():
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as err:
        torchrun(str(WORKERS / "crash_rank1.py"), nproc=2, timeout_s=60, echo=False)
    assert time.monotonic() - t0 < 60
    assert str(err.value) == ("rank 1 failed: ValueError: deliberate failure on rank 1 "
                              "(its full output is the error's .output)")  # echo=False
    assert "Traceback" in err.value.output


def test_a_program_one_line_error_is_the_summary():
    output = "\n".join([
        "[default0]:python -m tutorial_utils.bench.workers.collectives: error: collectives "
        "need several processes; use --nproc 2 or more",
        "Root Cause (first observed failure):", "  local_rank: 0 (pid: 12)"])
    assert failure_summary(output, 2) == (
        "rank 0 failed: python -m tutorial_utils.bench.workers.collectives: error: collectives "
        "need several processes; use --nproc 2 or more (full output above)")


def test_timeout_kills_the_job_and_returns():
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match="timed out after 3 s; all processes were killed"):
        torchrun(str(WORKERS / "hang.py"), nproc=2, timeout_s=3, echo=False)
    assert time.monotonic() - t0 < 30


def test_timeout_leaves_no_worker_behind_even_one_that_ignores_sigterm(tmp_path, monkeypatch):
    from tutorial_utils import launch

    monkeypatch.setattr(launch, "KILL_GRACE_S", 2.0)  # torchrun's own grace is 30 s
    pidfile = tmp_path / "pid"
    # long enough for both workers to start on a slow machine; the grace above stays short
    with pytest.raises(LaunchError, match="timed out"):
        torchrun(str(WORKERS / "ignores_sigterm.py"), [str(pidfile)], nproc=2, timeout_s=12,
                 echo=False)
    pids = [int((tmp_path / f"pid.{rank}").read_text()) for rank in range(2)]
    time.sleep(0.5)  # init reaps the orphans
    assert launch._gone(set(pids)) == set(pids)


def test_summary_without_torchrun_markers_falls_back_to_exit_code():
    assert failure_summary("nothing useful", 3) == "the job failed: exit code 3 (full output above)"


def test_summary_sees_through_torchs_rank_tags():
    output = "\n".join([
        "[default0]:[rank0]: Traceback (most recent call last):",
        "[default0]:[rank0]: RuntimeError: NCCL communicator was aborted",
        "Root Cause (first observed failure):",
        "  local_rank: 0 (pid: 12)",
    ])
    assert failure_summary(output, 1) == (
        "rank 0 failed: RuntimeError: NCCL communicator was aborted (full output above)"
    )


def test_summary_removes_a_tag_torchrun_wrote_mid_line():
    # Python writes an uncaught exception's line in pieces; torchrun's --tee, reading the
    # rank's log while it is written, can tag the second piece too.
    output = "[default1]:ValueError: deliberate [default1]:failure on rank 1"
    assert failure_summary(output, 1) == (
        "rank 1 failed: ValueError: deliberate failure on rank 1 (full output above)"
    )


def test_summary_reports_a_cpp_exception_that_ended_the_process():
    # What NCCL's watchdog leaves when a collective times out: no Python exception, the
    # process aborts through std::terminate.
    what = ("[PG ID 0 PG GUID 0(default_pg) Rank 0] Process group watchdog thread terminated "
            "with exception: [Rank 0] Watchdog caught collective operation timeout: "
            "WorkNCCL(SeqNum=2, OpType=ALLREDUCE) ran for 10004 milliseconds before timing out.")
    output = "\n".join([
        "[default1]:[rank1]: blocked in the data loader",
        "[default0]:terminate called after throwing an instance of 'c10::DistBackendError'",
        f"[default0]:  what():  {what}",
        "[default0]:Exception raised from checkTimeout at ProcessGroupNCCL.cpp:692",
        "[default0]:frame #1: c10d::ProcessGroupNCCL::WorkNCCL::checkTimeout(...)",
        "Root Cause (first observed failure):",
        "  local_rank: 0 (pid: 12)",
    ])
    assert failure_summary(output, -6) == (
        f"rank 0 failed: c10::DistBackendError: {what} (full output above)"
    )


def test_metrics_are_returned(tmp_path):
    script = tmp_path / "write.py"
    out = tmp_path / "m.jsonl"
    script.write_text(
        "import json, os\n"
        f"if os.environ['RANK'] == '0':\n"
        f"    open({str(out)!r}, 'a').write(json.dumps({{'world': os.environ['WORLD_SIZE']}}))\n"
    )
    # appended to, as a training run does: the stale line must be gone before the job starts
    out.write_text(json.dumps({"stale": True}) + "\n")
    result = torchrun(str(script), nproc=2, timeout_s=60, metrics_file=out, echo=False)
    assert result.metrics == [{"world": "2"}]


def test_kill_tree_spares_a_process_that_was_given_a_dead_childs_pid(monkeypatch):
    import subprocess

    from tutorial_utils import launch

    stranger = subprocess.Popen(["sleep", "60"])  # not the job's: it must survive
    job = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        # As if a child of the job had exited and the kernel had given its pid to the
        # stranger: the pid the job's listing holds, with the start time of the dead child.
        dead_child = {stranger.pid: launch._start_time(stranger.pid) - 1}
        monkeypatch.setattr(launch, "descendants", lambda pid: dict(dead_child))
        launch.kill_tree(job, grace_s=0.5)
        assert job.returncode is not None
        time.sleep(0.5)  # a SIGKILL, had one been sent, has arrived
        assert stranger.poll() is None, "kill_tree killed a process that was not the job's"
    finally:
        stranger.kill()
        stranger.wait()
