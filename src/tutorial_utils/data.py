"""CIFAR-10 from wherever it is.

Sources (:func:`load_cifar10`):

- a torchvision-layout folder (``cifar-10-batches-py``), downloaded into it first if allowed;
- an image-folder tree or tarball ``{train,test}/<class>/*.{png,jpg}``, decoded once and
  cached as a ``.npz`` beside it (or in ``cache_dir``);
- ``synthetic``: random CIFAR-shaped data, only when asked for, always labelled as such.

The loaders live in :mod:`tutorial_utils.loaders`; they are re-exported here for older imports.
"""

from __future__ import annotations

import hashlib
import io
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .loaders import DeviceLoader, dataloader, normalize, random_crop_flip

CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
__all__ = ["CLASSES", "Cifar10", "DataError", "DeviceLoader", "dataloader", "load_cifar10",
           "normalize", "random_crop_flip", "synthetic_cifar10"]


class DataError(RuntimeError):
    """No usable dataset; the message lists what to do."""


@dataclass(frozen=True)
class Cifar10:
    """Images as uint8 ``N x 3 x 32 x 32`` tensors, labels as int64."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    name: str  # where it came from; "synthetic" for made-up data

    @property
    def synthetic(self) -> bool:
        return self.name.startswith("synthetic")


def _hwc_to_chw(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2)))


def synthetic_cifar10(n_train: int = 5000, n_test: int = 1000, seed: int = 0) -> Cifar10:
    """Random images whose mean colour depends on the label, so a network can learn something."""
    g = torch.Generator().manual_seed(seed)

    def make(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.randint(0, 10, (n,), generator=g)
        base = (y.float() * 25).view(n, 1, 1, 1)
        noise = torch.randint(0, 64, (n, 3, 32, 32), generator=g).float()
        return (base + noise).clamp(0, 255).to(torch.uint8), y

    (tx, ty), (vx, vy) = make(n_train), make(n_test)
    return Cifar10(tx, ty, vx, vy, name=f"synthetic ({n_train} train / {n_test} test, seed {seed})")


def _from_torchvision(root: Path, download: bool) -> Cifar10:
    from torchvision.datasets import CIFAR10

    train = CIFAR10(str(root), train=True, download=download)
    test = CIFAR10(str(root), train=False, download=download)
    return Cifar10(
        _hwc_to_chw(train.data), torch.tensor(train.targets),
        _hwc_to_chw(test.data), torch.tensor(test.targets),
        name=f"CIFAR-10 ({root})",
    )


def _split_member(name: str) -> tuple[str, str] | None:
    """``.../train/cat/0001.jpg`` -> ("train", "cat"), or None for anything else."""
    parts = Path(name).parts
    if len(parts) < 3 or Path(name).suffix.lower() not in IMAGE_SUFFIXES:
        return None
    split, cls = parts[-3], parts[-2]
    return (split, cls) if split in ("train", "test") and cls in CLASSES else None


def _image_files(source: Path) -> Iterator[tuple[str, tuple[str, str], Callable[[], bytes]]]:
    """(name, (split, class), read) for every CIFAR image in a folder or tarball.

    Bytes are read only when asked for, so a ``limit_per_class`` skips the decoding work.
    """
    if source.is_dir():
        for f in sorted(source.rglob("*")):
            key = _split_member(str(f))
            if key and f.is_file():
                yield str(f.relative_to(source)), key, f.read_bytes
        return
    with tarfile.open(source) as tar:  # streamed once, in archive order
        for member in tar:
            key = _split_member(member.name)
            if key and member.isfile():
                yield member.name, key, tar.extractfile(member).read


def decode_image_folder(source: Path, limit_per_class: int | None = None) -> Cifar10:
    """Decode ``{train,test}/<class>/*`` from a folder or tarball (class order = CLASSES)."""
    from PIL import Image

    found: dict[str, list[tuple[str, int, bytes]]] = {"train": [], "test": []}
    counts: dict[tuple[str, str], int] = {}
    for name, key, read in _image_files(source):
        if limit_per_class is not None and counts.get(key, 0) >= limit_per_class:
            continue
        counts[key] = counts.get(key, 0) + 1
        found[key[0]].append((name, CLASSES.index(key[1]), read()))
    if not found["train"] or not found["test"]:
        raise DataError(
            f"{source} holds no train/<class>/*.jpg|png and test/<class>/* images; "
            "point --data at an image-folder tree or tarball of CIFAR-10"
        )
    arrays = []
    for split in ("train", "test"):
        items = sorted(found[split], key=lambda t: (t[1], t[0]))
        images = np.stack([np.asarray(Image.open(io.BytesIO(p)).convert("RGB")) for *_, p in items])
        if images.shape[1:] != (32, 32, 3):
            raise DataError(f"{source}: images must be 32x32 RGB, found {images.shape[1:3]}")
        arrays += [_hwc_to_chw(images), torch.tensor([c for _, c, _ in items])]
    return Cifar10(*arrays, name=f"CIFAR-10 image folder ({source.name})")


def _cache_path(source: Path, cache_dir: Path | None, limit: int | None) -> Path:
    stat = source.stat()
    key = hashlib.sha256(f"{source.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{limit}".encode())
    folder = cache_dir or (source.parent if source.is_file() else source)
    return folder / f".{source.name}.{key.hexdigest()[:16]}.npz"


def load_image_folder(
    source: Path, cache_dir: Path | None = None, limit_per_class: int | None = None
) -> Cifar10:
    """:func:`decode_image_folder`, cached: the 60,000 JPEGs are decoded once."""
    cache = _cache_path(source, cache_dir, limit_per_class)
    if cache.exists():
        with np.load(cache) as z:
            parts = [torch.from_numpy(z[k]) for k in ("train_x", "train_y", "test_x", "test_y")]
        return Cifar10(*parts, name=f"CIFAR-10 image folder ({source.name})")
    data = decode_image_folder(source, limit_per_class)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(".tmp.npz")
    np.savez(tmp, train_x=data.train_x.numpy(), train_y=data.train_y.numpy(),
             test_x=data.test_x.numpy(), test_y=data.test_y.numpy())
    tmp.replace(cache)  # atomic: a concurrent reader sees the old state or the whole file
    return data


def load_cifar10(
    source: str = "auto",
    data_dir: Path = Path("data"),
    download: bool = True,
    cache_dir: Path | None = None,
    limit_per_class: int | None = None,
) -> Cifar10:
    """Find CIFAR-10. ``source``: ``auto``, ``torchvision``, ``synthetic`` or a folder/tarball."""
    if source == "synthetic":
        return synthetic_cifar10()
    if source not in ("auto", "torchvision"):
        path = Path(source)
        if not path.exists():
            raise DataError(f"--data {source}: no such file or folder")
        return load_image_folder(path, cache_dir, limit_per_class)
    if (data_dir / "cifar-10-batches-py").is_dir():
        return _from_torchvision(data_dir, download=False)
    if download:
        try:
            return _from_torchvision(data_dir, download=True)
        except (OSError, RuntimeError) as err:  # URLError is an OSError
            reason = f"downloading into {data_dir} failed ({type(err).__name__})"
    else:
        reason = f"no CIFAR-10 in {data_dir} and downloading is off"
    raise DataError(
        f"{reason}; use --data-dir DIR with the torchvision layout, "
        "--data PATH to an image-folder tree or tarball (e.g. cifar10-jpeg.tar.gz), "
        "or --data synthetic for made-up data"
    )
