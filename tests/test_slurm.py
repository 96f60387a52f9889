"""The SLURM template, run by bash under a fake SLURM environment: no Slurm needed.

``srun``, ``scontrol`` and ``nvidia-smi`` are stubs placed first on PATH. They record their
arguments and environment and start nothing, so the tests read the command the script builds.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "slurm" / "wrn_ddp.sbatch"
BASH = shutil.which("bash")
pytestmark = pytest.mark.skipif(BASH is None, reason="needs bash")

JOB_ID = 4242424
HOSTS = ["gpu-a07", "gpu-a08"]
# The options of `python -m tutorial_utils.train` the template may use (and their choices).
TRAIN_OPTIONS = {
    "--depth", "--width", "--dropout", "--epochs", "--batch", "--scaling", "--lr", "--schedule",
    "--warmup-epochs", "--weight-decay", "--label-smoothing", "--crop-pad", "--tta", "--precision",
    "--compile", "--step-graph", "--loader", "--data", "--limit-per-class",
    "--device", "--out", "--checkpoint-every", "--resume", "--seed", "--deterministic",
}
TRAIN_CHOICES = {
    "--scaling": {"strong", "weak"}, "--schedule": {"warmup-linear", "step"},
    "--compile": {"none", "default", "reduce-overhead"}, "--loader": {"device", "dataloader"},
    "--device": {"auto", "cpu", "cuda"}, "--precision": {"bf16", "fp16", "fp32"},
}

STUB = """#!{bash}
# Record this call's arguments and environment (NUL-separated); run nothing.
n=$(ls "$STUB_LOG" | grep -c "^{name}\\.[0-9]*\\.args$" || true)
printf '%s\\0' "$@" > "$STUB_LOG/{name}.$n.args"
env -0 > "$STUB_LOG/{name}.$n.env"
{body}
"""
STUB_BODIES = {
    "srun": "exit 0",
    # STUB_HOST_COUNT: that many made-up nodes instead of STUB_HOSTS.
    "scontrol": 'if [ "$1 $2" != "show hostnames" ]; then exit 0; fi\n'
                'if [ -n "${STUB_HOST_COUNT:-}" ]; then\n'
                '  for ((i = 0; i < STUB_HOST_COUNT; i++)); do printf "node-%05d\\n" $i; done\n'
                'else printf "%s\\n" $STUB_HOSTS; fi',
    # `nvidia-smi -L` prints one line per GPU; STUB_GPUS unset: no driver, no GPUs.
    "nvidia-smi": 'if [ -z "${STUB_GPUS:-}" ]; then echo "NVIDIA-SMI has failed" >&2; exit 9; fi\n'
                  'for ((i = 0; i < STUB_GPUS; i++)); do\n'
                  '  echo "GPU $i: NVIDIA H200 (UUID: GPU-0000$i)"\n'
                  'done',
}


@dataclass
class Call:
    args: list[str]
    env: dict[str, str]


@dataclass
class Job:
    returncode: int
    stderr: str
    calls: dict[str, list[Call]]

    def srun(self) -> Call:
        assert self.returncode == 0, (self.returncode, self.stderr)
        assert len(self.calls["srun"]) == 1, "the script runs srun exactly once"
        return self.calls["srun"][0]

    def torchrun(self) -> tuple[list[str], list[str]]:
        """torchrun's own options, and the training entry point's options."""
        args = self.srun().args
        assert "torchrun" in args, args
        launcher = args[args.index("torchrun") + 1:]
        assert "-m" in launcher and launcher[launcher.index("-m") + 1] == "tutorial_utils.train"
        m = launcher.index("-m")
        return launcher[:m], launcher[m + 2:]

    def torchrun_option(self, name: str) -> str:
        options, _ = self.torchrun()
        values = [a.split("=", 1)[1] for a in options if a.startswith(f"{name}=")]
        assert len(values) == 1, f"{name} given {len(values)} times in {options}"
        return values[0]


def slurm_env(*, cpus: int = 32, **gpu_vars: str) -> dict[str, str]:
    """What Slurm sets in a batch job's environment (2 nodes), plus the GPU variables given."""
    return {
        "SLURM_JOB_ID": str(JOB_ID), "SLURM_JOB_NAME": "wrn-ddp", "SLURM_NNODES": "2",
        "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu-a[07-08]",
        "SLURM_NTASKS_PER_NODE": "1", "SLURM_CPUS_PER_TASK": str(cpus),
        "SLURM_CPUS_ON_NODE": str(cpus), "SLURM_SUBMIT_DIR": str(ROOT), **gpu_vars,
    }


def job_env(tmp_path: Path, env: dict[str, str], bodies: dict[str, str],
            visible_gpus: int | None = None) -> dict[str, str]:
    """The stubs written to ``tmp_path/bin``, and the environment a job runs them in."""
    stubs, log = tmp_path / "bin", tmp_path / "log"
    stubs.mkdir(parents=True)
    log.mkdir()
    for name, body in bodies.items():
        stub = stubs / name
        stub.write_text(STUB.format(bash=BASH, name=name, body=body))
        stub.chmod(0o755)
    # A clean environment: nothing from a real Slurm job (or a user's OMP_NUM_THREADS) leaks in.
    full_env = {"PATH": f"{stubs}:/usr/bin:/bin", "HOME": str(tmp_path), "STUB_LOG": str(log),
                "STUB_HOSTS": " ".join(HOSTS), **env}
    if visible_gpus is not None:
        full_env["STUB_GPUS"] = str(visible_gpus)
    return full_env


def stub_calls(tmp_path: Path, names) -> dict[str, list[Call]]:
    calls: dict[str, list[Call]] = {name: [] for name in names}
    for name in names:
        for args_file in sorted((tmp_path / "log").glob(f"{name}.*.args")):
            args = args_file.read_text().split("\0")[:-1]
            env_text = args_file.with_suffix(".env").read_text()
            variables = dict(v.split("=", 1) for v in env_text.split("\0") if "=" in v)
            calls[name].append(Call(args, variables))
    return calls


def run_job(tmp_path: Path, env: dict[str, str], *, visible_gpus: int | None = None,
            bodies: dict[str, str] = STUB_BODIES, args: tuple[str, ...] = (),
            cwd: Path = ROOT, timeout: float = 60) -> Job:
    full_env = job_env(tmp_path, env, bodies, visible_gpus)
    proc = subprocess.run([BASH, str(SCRIPT), *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout)
    return Job(proc.returncode, proc.stderr, stub_calls(tmp_path, bodies))


def sbatch_directives() -> dict[str, str]:
    """The ``#SBATCH --name=value`` lines sbatch reads: those before the first command."""
    directives = {}
    for line in SCRIPT.read_text().splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            break
        if stripped.startswith("#SBATCH"):
            option = stripped.split()[1]
            name, _, value = option.partition("=")
            directives[name] = value
    return directives


# 1. The log's folder must exist before the job starts: Slurm opens it, not the script.

def test_output_log_folder_exists_in_a_fresh_clone():
    output = sbatch_directives().get("--output")
    assert output, "the template names its log (#SBATCH --output=...) before any command"
    folder = Path(output).parent
    assert not folder.is_absolute()  # relative to the submit directory, the repository's root
    if folder != Path("."):
        # A fresh clone holds only the tracked files: the folder must contain one of them.
        tracked = subprocess.run(["git", "ls-files", "--", str(folder)], cwd=ROOT,
                                 capture_output=True, text=True, check=True).stdout
        assert tracked.strip(), f"{folder}/ does not exist in a fresh clone"


# 2. CPUs and GPUs: srun gets the CPUs, the workers share them, every way of asking for GPUs.

@pytest.mark.parametrize(("gpu_vars", "visible", "nproc"), [
    pytest.param({"SLURM_GPUS_PER_NODE": "4", "SLURM_GPUS_ON_NODE": "4"}, 8, "4",
                 id="gpus-per-node"),
    pytest.param({"SLURM_GPUS_PER_NODE": "h200:4", "SLURM_GPUS_ON_NODE": "4"}, 8, "4",
                 id="gpus-per-node-typed"),
    pytest.param({"SLURM_GPUS_ON_NODE": "4", "SLURM_JOB_GPUS": "0,1,2,3"}, 8, "4",
                 id="gres-gpus-on-node"),
    pytest.param({"SLURM_JOB_GPUS": "4,5,6,7"}, 8, "4", id="gres-job-gpus"),
    pytest.param({}, 4, "4", id="nvidia-smi"),
])
def test_nproc_per_node_under_gpus_per_node_and_gres(tmp_path, gpu_vars, visible, nproc):
    job = run_job(tmp_path, slurm_env(**gpu_vars), visible_gpus=visible)
    assert job.torchrun_option("--nproc_per_node") == nproc


def test_no_gpus_found_stops_before_srun(tmp_path):
    job = run_job(tmp_path, slurm_env())
    assert job.returncode != 0
    assert "GPU" in job.stderr
    assert job.calls["srun"] == []


def test_srun_gets_the_cpus_per_task(tmp_path):
    # Slurm >= 22.05: srun does not inherit sbatch's --cpus-per-task.
    srun = run_job(tmp_path, slurm_env(cpus=48, SLURM_GPUS_PER_NODE="4")).srun()
    options = srun.args[:srun.args.index("torchrun")]
    given = [a.split("=", 1)[1] for a in options if a.startswith("--cpus-per-task=")]
    assert given == ["48"] or (not given and srun.env.get("SRUN_CPUS_PER_TASK") == "48")


@pytest.mark.parametrize(("cpus", "gpus", "threads"), [(32, 8, "4"), (48, 4, "12"), (2, 4, "1")])
def test_omp_threads_share_the_cpus_among_the_workers(tmp_path, cpus, gpus, threads):
    srun = run_job(tmp_path, slurm_env(cpus=cpus, SLURM_GPUS_PER_NODE=str(gpus))).srun()
    assert srun.env.get("OMP_NUM_THREADS") == threads


# 3. The recipe chapter 5 measured (record 05-wrn-runs), with the entry point's options only.

def test_train_options_are_the_recipe_chapter_5_measured(tmp_path):
    import json

    from tutorial_utils.config import parse
    from tutorial_utils.trainer import MUST_MATCH_ON_RESUME, TrainConfig, saved_train_config

    _, train = run_job(tmp_path, slurm_env(SLURM_GPUS_PER_NODE="8")).torchrun()
    options = [a for a in train if a.startswith("--")]
    assert set(options) <= TRAIN_OPTIONS, f"unknown options: {set(options) - TRAIN_OPTIONS}"
    values = {a: train[i + 1] for i, a in enumerate(train[:-1]) if a in TRAIN_CHOICES}
    for option, value in values.items():
        assert value in TRAIN_CHOICES[option], f"{option} {value}"
    assert "--resume" in train
    cfg = parse(TrainConfig, [a for a in train if a != "--resume"], "train")
    record = ROOT / "book" / "data" / "05-wrn-runs.jsonl"
    assert "05-wrn-runs" in SCRIPT.read_text(), "the template cites the record of its recipe"
    starts = [json.loads(line) for line in record.read_text().splitlines()]
    (measured,) = [r for r in starts if r.get("run") == "2 GPUs, 64 images each"
                   and r["event"] == "start"]
    saved = saved_train_config(measured["config"])
    differ = {k: (getattr(cfg, k), saved[k]) for k in MUST_MATCH_ON_RESUME
              if getattr(cfg, k) != saved[k]}
    assert not differ, f"the template trains another recipe than the record's: {differ}"
    assert cfg.scaling == "strong" and cfg.batch == 128 and cfg.lr == 0.1


# 4. Its assumptions, in comments above the directives; and one launcher per node.

def test_assumptions_are_stated_at_the_top_and_srun_starts_one_launcher_per_node(tmp_path):
    lines = SCRIPT.read_text().splitlines()
    first_directive = next(i for i, line in enumerate(lines) if line.startswith("#SBATCH"))
    header = " ".join(line.lstrip("# ") for line in lines[1:first_directive]).lower()
    for assumption in ["shared filesystem", "same python environment on every node",
                       "srun --ntasks-per-node=1"]:
        assert assumption in header, f"the header does not say: {assumption}"
    srun = run_job(tmp_path, slurm_env(SLURM_GPUS_PER_NODE="8")).srun()
    assert "--ntasks-per-node=1" in srun.args[:srun.args.index("torchrun")]


# 5. The launcher command: nodes, rendezvous on the first node, a port from the job id.

def test_torchrun_meets_on_the_first_node_at_a_port_from_the_job_id(tmp_path):
    job = run_job(tmp_path, slurm_env(SLURM_GPUS_PER_NODE="8"))
    assert job.torchrun_option("--nnodes") == "2"
    assert job.torchrun_option("--nproc_per_node") == "8"
    assert [c.args for c in job.calls["scontrol"]] == [["show", "hostnames", "gpu-a[07-08]"]]
    assert job.torchrun_option("--rdzv-endpoint") == f"{HOSTS[0]}:{20000 + JOB_ID % 20000}"
    assert job.torchrun_option("--rdzv-backend") == "c10d"
    assert job.torchrun_option("--rdzv-id") == str(JOB_ID)
    assert int(job.torchrun_option("--max-restarts")) >= 1
    assert job.calls["nvidia-smi"] == []  # SLURM_GPUS_PER_NODE answers first


def test_head_node_of_a_long_node_list(tmp_path):
    # More names than a pipe holds: a reader that stops at the first line kills scontrol with
    # SIGPIPE, which fails the whole job under `set -o pipefail`.
    env = {**slurm_env(SLURM_GPUS_PER_NODE="8"), "STUB_HOST_COUNT": "10000"}
    job = run_job(tmp_path, env)
    assert job.torchrun_option("--rdzv-endpoint") == f"node-00000:{20000 + JOB_ID % 20000}"


# 6. A chain of jobs: a resubmission resumes where the last job stopped; the time limit
#    requeues the job.

# srun and torchrun that run the training, on this machine: one process per job, on the CPU.
RUNNING_BODIES = {
    **STUB_BODIES,
    "srun": 'while [[ ${1:-} == -* ]]; do shift; done\nexec "$@"',
    "torchrun": 'while [[ $# -gt 0 && $1 != -m ]]; do shift; done\nshift\n'
                'exec "$STUB_PYTHON" -m "$@"',
}
# Options after the script's name: a tiny network on 200 synthetic images, 3 steps an epoch.
TINY = ("--depth", "10", "--width", "1", "--epochs", "3", "--batch", "64", "--data",
        "synthetic", "--limit-per-class", "20", "--device", "cpu", "--precision", "fp32")


def chained_job(tmp_path: Path, job_id: int, **env: str) -> Job:
    import sys

    import tutorial_utils

    submit = tmp_path / "submit"  # where sbatch ran: runs/ goes there
    submit.mkdir(exist_ok=True)
    variables = {**slurm_env(SLURM_GPUS_PER_NODE="1"), "SLURM_JOB_ID": str(job_id),
                 "SLURM_JOB_NAME": "wrn-chain", "STUB_PYTHON": sys.executable,
                 "PYTHONPATH": str(Path(tutorial_utils.__file__).parents[1]), **env}
    return run_job(tmp_path / str(job_id), variables, bodies=RUNNING_BODIES, args=TINY,
                   cwd=submit, timeout=300)


def test_a_resubmitted_job_resumes_where_the_last_one_stopped(tmp_path):
    from tutorial_utils.jsonl import read_jsonl
    from tutorial_utils.trainer import CRASH_ENV

    run = tmp_path / "submit" / "runs" / "slurm" / "wrn-chain"  # named by the job's name
    # The first job dies in epoch 2, after the checkpoint of epoch 1: its time limit, a node
    # lost. The second, submitted again under the same name, gets another job id.
    first = chained_job(tmp_path, 1001, **{CRASH_ENV: "4"})
    assert first.returncode != 0, first.stderr
    assert torch_load(run / "checkpoint.pt")["epoch"] == 0
    second = chained_job(tmp_path, 1002)
    assert second.returncode == 0, second.stderr
    assert "training from epoch 1" not in second.stderr
    records = read_jsonl(run / "metrics.jsonl")
    assert [r["start_epoch"] for r in records if r["event"] == "start"] == [0, 1]
    assert [r["epoch"] for r in records if r["event"] == "epoch"] == [1, 2, 3]
    assert torch_load(run / "checkpoint.pt")["epoch"] == 2


def torch_load(path: Path) -> dict:
    import torch

    return torch.load(path, weights_only=True)


def test_the_time_limit_signal_requeues_the_job(tmp_path):
    import signal
    import time

    directives = sbatch_directives()
    assert "--requeue" in directives and directives.get("--open-mode") == "append"
    when = directives.get("--signal", "")
    assert when.startswith("B:USR1@") and int(when.split("@")[1]) >= 60  # to the script
    bodies = {**STUB_BODIES,
              # srun runs until killed; `scontrol requeue` kills it, as Slurm ends the job
              "srun": 'echo $$ > "$STUB_LOG/srun.pid"\nexec sleep 60',
              "scontrol": 'if [ "$1" = requeue ]; then kill "$(cat "$STUB_LOG/srun.pid")"; '
                          'exit 0; fi\n' + STUB_BODIES["scontrol"]}
    env = job_env(tmp_path, slurm_env(SLURM_GPUS_PER_NODE="8"), bodies)
    job = subprocess.Popen([BASH, str(SCRIPT)], cwd=ROOT, env=env, stderr=subprocess.PIPE,
                           text=True)
    deadline = time.monotonic() + 30
    while not (tmp_path / "log" / "srun.pid").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    job.send_signal(signal.SIGUSR1)  # what Slurm sends 120 s before the time limit
    _, stderr = job.communicate(timeout=30)
    requeues = [c.args for c in stub_calls(tmp_path, bodies)["scontrol"]
                if c.args[:1] == ["requeue"]]
    assert requeues == [["requeue", str(JOB_ID)]], stderr
    assert "time limit near: requeueing job" in stderr
    assert job.returncode != 0  # ended by Slurm, to run again
