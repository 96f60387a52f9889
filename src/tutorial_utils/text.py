"""Text to train a language model on, without a download: Python's own standard library.

Every Python installation carries its standard library as source, several megabytes of it:
:func:`stdlib_corpus` reads those ``.py`` files in a fixed order, as bytes, so the tokenizer is
the identity (a vocabulary of 256) and nothing needs fetching. Which Python it came from changes
the text a little; :class:`Corpus` says which. :func:`synthetic_corpus` is random bytes of the
same shape, for quick runs. :func:`batch` cuts random windows out of either.
"""

from __future__ import annotations

import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Corpus:
    train: torch.Tensor  # uint8 bytes
    val: torch.Tensor
    name: str


def _split(data: torch.Tensor, name: str, val_fraction: float) -> Corpus:
    cut = int(len(data) * (1 - val_fraction))
    return Corpus(data[:cut], data[cut:], name)


def stdlib_corpus(max_bytes: int = 16_000_000, val_fraction: float = 0.05,
                  root: Path | None = None) -> Corpus:
    """The first ``max_bytes`` of the standard library's ``.py`` files, sorted by path; the last
    ``val_fraction`` of it is held out for validation."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    chunks, size = [], 0
    for path in files:
        if size >= max_bytes:
            break
        try:
            chunks.append(path.read_bytes())
        except OSError:  # an unreadable file is skipped: the corpus is any text, not this one
            continue
        size += len(chunks[-1])
    data = b"".join(chunks)[:max_bytes]
    if len(data) < 10_000:
        raise FileNotFoundError(f"found only {len(data)} bytes of Python source under {root}; "
                                "pass another root, or use the synthetic corpus")
    version = ".".join(map(str, sys.version_info[:2]))
    name = f"Python {version} standard library ({len(data) / 1e6:.1f} MB of .py files)"
    return _split(torch.frombuffer(bytearray(data), dtype=torch.uint8), name, val_fraction)


def synthetic_corpus(n_bytes: int = 1_000_000, seed: int = 0, val_fraction: float = 0.05) -> Corpus:
    """Uniformly random bytes: nothing to learn beyond a loss of ln 256."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (n_bytes,), dtype=torch.uint8, generator=g)
    return _split(data, f"synthetic ({n_bytes / 1e6:.1f} MB of random bytes)", val_fraction)


def batch(data: torch.Tensor, batch_size: int, seq: int, generator: torch.Generator,
          device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` random windows of ``seq`` bytes and the same windows one byte later."""
    if len(data) <= seq:
        raise ValueError(f"the text has {len(data)} bytes, fewer than a window of {seq} + 1")
    start = torch.randint(0, len(data) - seq, (batch_size,), generator=generator)
    window = torch.stack([data[s : s + seq + 1] for s in start.tolist()]).to(device).long()
    return window[:, :-1], window[:, 1:]
