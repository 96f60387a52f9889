import json
import re
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
    # Python writes an uncaught exception's line in pieces; torchrun's --tee, reading the
    # rank's log while it is written, can tag the second piece "[default1]:" mid-line.
    summary = re.sub(r"\[default\d+\]:", "", str(err.value))
    assert summary == "rank 1 failed: ValueError: deliberate failure on rank 1 (full output above)"
    assert "Traceback" in err.value.output


def test_timeout_kills_the_job_and_returns():
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match="timed out after 3 s; all processes were killed"):
        torchrun(str(WORKERS / "hang.py"), nproc=2, timeout_s=3, echo=False)
    assert time.monotonic() - t0 < 30


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


def test_metrics_are_returned(tmp_path):
    script = tmp_path / "write.py"
    out = tmp_path / "m.jsonl"
    script.write_text(
        "import json, os\n"
        f"if os.environ['RANK'] == '0':\n"
        f"    open({str(out)!r}, 'w').write(json.dumps({{'world': os.environ['WORLD_SIZE']}}))\n"
    )
    out.write_text(json.dumps({"stale": True}))  # removed before the job starts
    result = torchrun(str(script), nproc=2, timeout_s=60, metrics_file=out, echo=False)
    assert result.metrics == [{"world": "2"}]
