"""The environment stamp: what hardware and software a result was measured on.

Every executed notebook shows one, and the notebook executor stores one in the notebook's
metadata, so each number in the book can be traced to the machine that produced it.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch


@dataclass(frozen=True, repr=False)
class EnvironmentStamp:
    gpu_count: int
    gpu_names: tuple[str, ...]
    gpu_memory_gib: tuple[float, ...]
    interconnect: str
    driver: str
    cuda_runtime: str
    cudnn: str
    torch: str
    torchvision: str
    python: str
    cpu: str  # the architecture, such as x86_64
    cpu_model: str  # such as "AMD EPYC 9454 48-Core Processor"
    cpu_count: int
    nccl: str  # the NCCL version torch was built with, or "-" without NCCL
    git_commit: str
    date_utc: str
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def hardware(self) -> str:
        """A short label such as ``2 x NVIDIA H200`` or ``CPU only (Intel Xeon ..., 2 cores)``."""
        if self.gpu_count == 0:
            return f"CPU only ({self.cpu_model}, {self.cpu_count} cores)"
        names = sorted(set(self.gpu_names))
        return f"{self.gpu_count} x {' + '.join(names)}"

    @property
    def is_gpu(self) -> bool:
        return self.gpu_count > 0

    def as_dict(self) -> dict:
        return asdict(self)

    def rows(self) -> list[tuple[str, str]]:
        mem = ", ".join(f"{m:.0f} GiB" for m in self.gpu_memory_gib) or "-"
        return [
            ("hardware", self.hardware),
            ("GPU memory", mem),
            ("GPU interconnect", self.interconnect),
            ("CPU", f"{self.cpu_model} ({self.cpu}, {self.cpu_count} cores)"),
            ("driver / CUDA / cuDNN", f"{self.driver} / {self.cuda_runtime} / {self.cudnn}"),
            ("NCCL", self.nccl),
            ("torch / torchvision", f"{self.torch} / {self.torchvision}"),
            ("python", self.python),
            ("git commit", self.git_commit),
            ("date (UTC)", self.date_utc),
        ]

    def _repr_markdown_(self) -> str:
        lines = ["| measured on | |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in self.rows()]
        return "\n".join(lines)

    def __str__(self) -> str:
        width = max(len(k) for k, _ in self.rows())
        return "\n".join(f"{k:<{width}}  {v}" for k, v in self.rows())

    __repr__ = __str__


def _run(cmd: list[str], cwd: Path | None = None) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _driver_version() -> str:
    out = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return out.splitlines()[0].strip() if out else "-"


def interconnect(gpu_count: int) -> str:
    """How the GPUs talk to each other: NVLink, PCIe, or unknown (from ``nvidia-smi topo``)."""
    if gpu_count < 2:
        return "-"
    topo = _run(["nvidia-smi", "topo", "-m"])
    if topo:
        # The matrix row of GPU0 lists the link to each other GPU: NV<n> means n NVLinks;
        # PIX/PXB/PHB/NODE/SYS are PCIe paths of increasing distance.
        row = next((ln.split() for ln in topo.splitlines() if ln.startswith("GPU0")), None)
        if row:
            links = [c for c in row[1 : gpu_count + 1] if c != "X"]
            if links and all(c.startswith("NV") for c in links):
                return f"NVLink ({', '.join(sorted(set(links)))})"
            if links:
                return f"PCIe ({', '.join(sorted(set(links)))})"
    p2p = all(
        torch.cuda.can_device_access_peer(0, j) for j in range(1, gpu_count)
    )
    return "peer access (link type unknown)" if p2p else "no peer access (through host)"


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's marketing name: Linux's ``model name`` line, else what ``platform`` knows."""
    try:
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return " ".join(value.split())
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def nccl_version() -> str:
    """The NCCL version this torch was built with (``2.27.5``), or ``-`` without NCCL."""
    if not (torch.distributed.is_available() and torch.distributed.is_nccl_available()):
        return "-"
    try:
        version = torch.cuda.nccl.version()
    except (RuntimeError, AttributeError):
        return "-"
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _git_commit() -> str:
    """``TUTORIAL_GIT_COMMIT`` when set (a copy of the repository whose git metadata lags its
    files), else what git says of the checkout, ``+dirty`` with uncommitted changes to anything
    but notebooks (executing the book rewrites their outputs; their code is checked apart)."""
    if commit := os.environ.get("TUTORIAL_GIT_COMMIT"):
        return commit
    here = Path(__file__).resolve().parent
    commit = _run(["git", "rev-parse", "--short=12", "HEAD"], cwd=here)
    if commit is None:
        return "unknown"
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here) or ""
    dirty = [line for line in status.splitlines() if not line.rstrip().endswith(".ipynb")]
    return commit + ("+dirty" if dirty else "")


def environment_stamp() -> EnvironmentStamp:
    """Collect the stamp for this process (a few hundred ms: it asks ``nvidia-smi``)."""
    import torchvision

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    props = [torch.cuda.get_device_properties(i) for i in range(n)]
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return EnvironmentStamp(
        gpu_count=n,
        gpu_names=tuple(p.name for p in props),
        gpu_memory_gib=tuple(p.total_memory / 2**30 for p in props),
        interconnect=interconnect(n),
        driver=_driver_version() if n else "-",
        cuda_runtime=torch.version.cuda or "-",
        cudnn=str(cudnn) if cudnn else "-",
        torch=torch.__version__,
        torchvision=torchvision.__version__,
        python=platform.python_version(),
        cpu=platform.machine(),
        cpu_model=cpu_model(),
        cpu_count=os.cpu_count() or 1,
        nccl=nccl_version(),
        git_commit=_git_commit(),
        date_utc=_dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M"),
    )
