"""Chapter 6's NCCL_DEBUG lines: what NCCL says it built for a DDP job on this machine's GPUs.

    python -m tutorial_utils.bench.nccl --gpus 2 --record    # the record 06-nccl-<N>gpu

A short DDP job (:mod:`tutorial_utils.workers.ddp_minimal`) runs on N GPUs with
``NCCL_DEBUG=INFO`` and every rank's log in a file; :func:`tutorial_utils.debugging.nccl_links`
reads the version, the network between hosts and the transport of each pair of ranks out of
them. The lines are a GPU measurement: the chapter reads them from a record.
"""

from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..config import Config, check, check_gpus, opt, parse_or_exit
from ..debugging import nccl_links
from ..launch import torchrun
from . import records

WORKER = "tutorial_utils.workers.ddp_minimal"


def record_name(gpus: int) -> str:
    return f"06-nccl-{gpus}gpu"


@dataclass
class NcclConfig(Config):
    """What NCCL builds for a DDP job on N GPUs, from its NCCL_DEBUG=INFO log."""

    gpus: int = opt(1, "GPUs, one process each")
    record: bool = opt(False, "write the lines as the record 06-nccl-<N>gpu (book/data)")

    def __post_init__(self) -> None:
        check((self.gpus >= 1, f"--gpus must be >= 1, got {self.gpus}"))


@dataclass
class NcclLine:
    line: str  # one line of the summary, as the chapter prints it


def measure(gpus: int) -> list[NcclLine]:
    """Run the DDP job on ``gpus`` GPUs with NCCL's log on; the summary's lines."""
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(tmp)
        torchrun(WORKER, ["--epochs", "1", "--out", str(logs / "ddp")], nproc=gpus,
                 timeout_s=300, echo=False,
                 env={"NCCL_DEBUG": "INFO", "NCCL_DEBUG_FILE": f"{logs}/nccl.%h.%p.log"})
        log = "".join(p.read_text() for p in sorted(logs.glob("nccl.*.log")))
    return [NcclLine(line) for line in nccl_links(log).lines()]


def for_machine(n_gpus: int) -> NcclConfig:
    """Two GPUs' lines where they have a record or this machine has two; else one GPU's."""
    two = records.path_of(record_name(2)).exists()
    return NcclConfig(gpus=2 if two or n_gpus >= 2 else 1)


def measured(cfg: NcclConfig) -> tuple[list[NcclLine], records.Source]:
    """The record's lines, or (TUTORIAL_MEASURE=1) this machine's GPUs'; none without either:
    gloo between CPU processes writes no such log."""
    return records.measured(record_name(cfg.gpus), lambda: measure(cfg.gpus), gpus=cfg.gpus,
                            cfg=cfg, row_type=NcclLine)


def main(argv: list[str] | None = None) -> None:
    cfg = parse_or_exit(NcclConfig, argv, __spec__.name,
                        lambda c: check_gpus(c.gpus, "--gpus", "a machine with GPUs"))
    rows = measure(cfg.gpus)
    print("\n".join(r.line for r in rows))
    if cfg.record:
        path = records.write(record_name(cfg.gpus), dataclasses.replace(cfg, record=True), rows,
                             __spec__.name, [WORKER], gpus=cfg.gpus,
                             what=f"Chapter 6: NCCL's own account of a DDP job on "
                                  f"{'one GPU' if cfg.gpus == 1 else f'{cfg.gpus} GPUs'}, from "
                                  "NCCL_DEBUG=INFO")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
