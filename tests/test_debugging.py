"""The debugging toolbox: DETAIL debugging, stack dumps and flight records on failures made here."""

import pytest

from tutorial_utils.launch import LaunchError, torchrun
from tutorial_utils.workers.mismatch_demo import summary


def _fail(mismatch, env) -> str:
    """The full output of the mismatched job, which must fail."""
    with pytest.raises(LaunchError) as err:
        torchrun("tutorial_utils.workers.mismatch_demo", ["--mismatch", mismatch, "--timeout",
                                                            "10"], nproc=2, timeout_s=120,
                 env=env, echo=False)
    return err.value.output


def _said(output: str) -> list[str]:
    """What the ranks said about their collectives, one line each."""
    return [s for s in map(summary, output.splitlines()) if s]


@pytest.mark.parametrize(("mismatch", "expected"), [
    ("shape", {"rank 0 called ALLREDUCE on shape [4], rank 1 ALLREDUCE on shape [8]",
               "rank 1 called ALLREDUCE on shape [8], rank 0 ALLREDUCE on shape [4]"}),
    ("op", {"rank 0 called ALLREDUCE on shape [4], rank 1 BROADCAST on shape [4]",
            "rank 1 called BROADCAST on shape [4], rank 0 ALLREDUCE on shape [4]"}),
])
def test_detail_debugging_names_the_ranks_and_their_collectives(mismatch, expected):
    assert set(_said(_fail(mismatch, {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}))) == expected


def test_without_it_the_job_fails_without_saying_why():
    output = _fail("shape", {"TORCH_DISTRIBUTED_DEBUG": "OFF"})
    assert _said(output) == []
    # it failed in the mismatched all-reduce (gloo's check of the bytes), not somewhere else
    assert "op.preamble.length <= op.nbytes" in output
    assert "Detected mismatch" not in output


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


def test_a_rank_still_importing_is_starting_not_stuck(tmp_path, monkeypatch):
    import os

    from tutorial_utils import debugging

    # a py-spy whose first three dumps find the main thread compiling a module, then in a
    # collective: only the later, standing-still stack is the stuck one
    count = tmp_path / "count"
    fake = tmp_path / "py-spy"
    fake.write_text(f"""#!/bin/sh
n=$(cat {count} 2>/dev/null || echo 0); echo $((n + 1)) > {count}
echo 'Thread 7 (idle): "MainThread"'
if [ "$n" -lt 3 ]; then
  echo '    get_code (<frozen importlib._bootstrap_external>:1129)'
  echo '    main (hang_demo.py:1)'
else
  echo '    all_reduce (c10d.py:30)'
  echo '    main (hang_demo.py:73)'
fi
""")
    fake.chmod(0o755)
    monkeypatch.setattr(debugging, "py_spy", lambda: str(fake))
    monkeypatch.setattr(debugging, "worker_ranks", lambda pid: {0: os.getpid()})
    where = debugging.stuck_stacks(0, frames=2, wait_s=10, every_s=0.01)
    assert where == {0: ["all_reduce (c10d.py:30)", "main (hang_demo.py:73)"]}


# NCCL_DEBUG=INFO lines of a two-host job (2 GPUs each), as NCCL 2.28 writes them
NCCL_LOG = """\
h1:101:101 [0] NCCL INFO NCCL version 2.28.9+cuda13.0
h1:101:101 [0] NCCL INFO Using network IB
h1:101:101 [0] NCCL INFO comm 0x55d0 rank 0 nranks 4 cudaDev 0 nvmlDev 0 busId 18000 - Init START
h1:102:102 [1] NCCL INFO comm 0x55e0 rank 1 nranks 4 cudaDev 1 nvmlDev 1 busId 2a000 - Init START
h1:101:101 [0] NCCL INFO Channel 00/02 :    0   1   2   3
h1:101:140 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read
h1:101:140 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[1] via P2P/CUMEM/read
h1:102:141 [1] NCCL INFO Channel 00/0 : 1[1] -> 2[0] [send] via NET/IB/0/GDRDMA
h1:102:141 [1] NCCL INFO Channel 01/0 : 1[1] -> 2[0] [send] via NET/IB/0/GDRDMA
h2:201:150 [0] NCCL INFO Channel 00/0 : 1[1] -> 2[0] [receive] via NET/IB/0/GDRDMA
h2:201:150 [0] NCCL INFO Channel 00/0 : 2[0] -> 3[1] via SHM/direct/direct
h1:101:101 [0] NCCL INFO comm 0x55d0 rank 0 nranks 4 cudaDev 0 busId 18000 - Init COMPLETE
"""


def test_nccl_links_names_each_pair_s_transport_and_channels():
    from tutorial_utils.debugging import nccl_links

    links = nccl_links(NCCL_LOG)
    assert (links.version, links.network, links.ranks) == ("2.28.9+cuda13.0", "IB", 4)
    assert links.links == {(0, 1): {"P2P/CUMEM/read": 2}, (1, 2): {"NET/IB/0/GDRDMA": 2},
                           (2, 3): {"SHM/direct/direct": 1}}  # a send and its receive: 1 channel
    assert links.lines()[1:] == ["rank 0 -> rank 1: P2P/CUMEM/read on 2 channels",
                                 "rank 1 -> rank 2: NET/IB/0/GDRDMA on 2 channels",
                                 "rank 2 -> rank 3: SHM/direct/direct on 1 channel"]


def test_nccl_links_of_one_rank_and_of_no_nccl_log():
    from tutorial_utils.debugging import nccl_links

    one = nccl_links("\n".join(NCCL_LOG.splitlines()[:3]).replace("nranks 4", "nranks 1"))
    assert one.ranks == 1 and one.links == {} and "no connection" in one.lines()[1]
    with pytest.raises(ValueError, match="NCCL_DEBUG=INFO"):
        nccl_links("[rank0]: gloo: connected to 127.0.0.1\n")


@pytest.mark.gpu
def test_nccl_links_of_a_ddp_job_on_this_machine_s_gpus(tmp_path):
    import torch

    from tutorial_utils.debugging import nccl_links

    procs = min(torch.cuda.device_count(), 2)
    logs = tmp_path / "nccl"
    logs.mkdir()
    torchrun("tutorial_utils.workers.ddp_minimal", ["--epochs", "1", "--out", str(tmp_path)],
             nproc=procs, timeout_s=300, echo=False,
             env={"NCCL_DEBUG": "INFO", "NCCL_DEBUG_FILE": f"{logs}/nccl.%h.%p.log"})
    links = nccl_links("".join(p.read_text() for p in logs.iterdir()))
    assert links.ranks == procs
    assert bool(links.links) == (procs > 1)  # two GPUs: each direction of the pair has a link
    if procs > 1:
        assert {(0, 1), (1, 0)} <= set(links.links)
