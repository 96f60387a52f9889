"""CIFAR-10 from wherever it is (:func:`load_cifar10`); the loaders are in :mod:`.loaders`.

- torchvision's layout (``cifar-10-batches-py``), in ./data (downloaded there) or a given folder;
- an image-folder tree ``{train,test}/<class>/*.{png,jpg}`` or a tarball of one, decoded once and
  cached as a ``.npz`` beside it (or in ``cache_dir``);
- ``synthetic``: random CIFAR-shaped data, only when asked for, always labelled as such.
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
import tempfile
import warnings
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

# re-exported: older code imports the loaders from here

CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
_ARRAYS = ("train_x", "train_y", "test_x", "test_y")
_AGAIN = "copy or download it again"
_PASS = "pass --data an image-folder tree or a tarball of one, or a torchvision-layout folder"


class DataError(RuntimeError):
    """No usable dataset; the message, one line, names the culprit and says what to do."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))  # causes quoted in it may span lines


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


def first_per_class(data: Cifar10, limit: int | None) -> Cifar10:
    """The first ``limit`` training images of each class (all of them for None); test set whole."""
    if limit is None:
        return data
    keep = torch.cat([torch.nonzero(data.train_y == c).flatten()[:limit] for c in range(10)])
    keep = keep.sort().values
    return Cifar10(data.train_x[keep], data.train_y[keep], data.test_x, data.test_y,
                   name=f"{data.name}, {limit} per class")


def _from_torchvision(root: Path, download: bool) -> Cifar10:
    """torchvision's copy under ``root``; with ``download``, fetched there first if missing."""
    from torchvision.datasets import CIFAR10

    try:
        train = CIFAR10(str(root), train=True, download=download)
        test = CIFAR10(str(root), train=False)
    except (OSError, RuntimeError, EOFError, tarfile.TarError) as err:  # URLError: an OSError
        why = f"{type(err).__name__}: {err}"
        raise DataError(
            f"no CIFAR-10 in {root.resolve()} and downloading it there failed ({why}); {_PASS} "
            "(e.g. cifar10-jpeg.tar.gz), or download it there first while online" if download
            else f"{root / 'cifar-10-batches-py'} is incomplete or damaged ({why}); delete it "
            f"and download it again, or {_PASS}") from None
    return Cifar10(_hwc_to_chw(train.data), torch.tensor(train.targets),
                   _hwc_to_chw(test.data), torch.tensor(test.targets), name=f"CIFAR-10 ({root})")


def _split_member(name: str) -> tuple[str, str] | None:
    """``.../train/cat/0001.jpg`` -> ("train", "cat"), any class name; None if not an image."""
    parts = Path(name).parts
    if len(parts) < 3 or Path(name).suffix.lower() not in IMAGE_SUFFIXES:
        return None
    return (parts[-3], parts[-2]) if parts[-3] in ("train", "test") else None


def _entries(source: Path) -> Iterator[tuple[str, Callable[[], bytes]]]:
    """(path inside, read) for every file of a folder or tarball."""
    if source.is_dir():
        for f in sorted(source.rglob("*")):
            if f.is_file():
                yield str(f.relative_to(source)), f.read_bytes
        return
    if source.stat().st_size == 0:
        raise DataError(f"{source} is empty; {_AGAIN}")
    try:
        tar = tarfile.open(source)
    except tarfile.ReadError:
        raise DataError(f"{source} is not a .tar or .tar.gz archive; {_PASS}") from None
    with tar:  # streamed once, in archive order
        for member in tar:
            if member.isfile():
                yield member.name, tar.extractfile(member).read
        # tarfile stops quietly where a cut falls between two members; a whole archive ends
        # in a zero block, which the loop has just read
        if tar.fileobj.tell() < tar.offset + tarfile.BLOCKSIZE:
            raise tarfile.ReadError("it ends before its end-of-archive marker")


def _collect(source: Path, limit: int | None) -> dict[tuple[str, str], list[tuple[str, bytes]]]:
    """(path or archive:member, bytes) by (split, class); beyond ``limit`` training images of a
    class none are read (the test split is read whole, as from torchvision's copy)."""
    found: dict[tuple[str, str], list[tuple[str, bytes]]] = {}
    is_dir = source.is_dir()
    try:
        for name, read in _entries(source):
            key = _split_member(name)
            if key is not None:
                images = found.setdefault(key, [])
                if limit is None or key[0] == "test" or len(images) < limit:
                    where = str(source / name) if is_dir else f"{source}:{name}"
                    images.append((where, read()))
    except (tarfile.TarError, EOFError, zlib.error, OSError) as err:
        raise DataError(f"{source} is truncated or unreadable ({err}); {_AGAIN}") from None
    return found


def _check_classes(source: Path, found: dict[tuple[str, str], list]) -> None:
    """All ten classes in both splits, or an error naming what is missing and what was found."""
    problems = []
    for split in ("train", "test"):
        have = sorted(cls for s, cls in found if s == split)
        missing = [f"{split}/{c}" for c in CLASSES if c not in have]
        if not have:
            problems.append(f"{split}/ missing")
        elif missing:
            problems.append(f"{', '.join(missing)} missing (found {', '.join(have)})")
    if problems:
        raise DataError(f"{source}: {'; '.join(problems)}; it needs train/<class>/ and "
                        f"test/<class>/ folders of .png or .jpg images for {', '.join(CLASSES)}")


def _decode(name: str, payload: bytes) -> np.ndarray:
    """One image as 32 x 32 x 3 uint8; a broken or odd-sized one is named."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(payload)) as image:
            pixels = np.asarray(image.convert("RGB"))
    except Exception as err:  # PIL reports broken files as OSError, SyntaxError, ValueError...
        raise DataError(f"{name} is not a readable image ({err}); replace or remove it") from None
    if pixels.shape != (32, 32, 3):
        h, w = pixels.shape[:2]
        raise DataError(f"{name} is {w}x{h}, not 32x32 like CIFAR-10; resize or remove it")
    return pixels


def _decode_image_folder(source: Path, limit_per_class: int | None) -> Cifar10:
    """Decode ``{train,test}/<class>/*`` from a folder or tarball (class order = CLASSES)."""
    found = _collect(source, limit_per_class)
    _check_classes(source, found)
    arrays = []
    for split in ("train", "test"):
        items = [(c, *item) for c, cls in enumerate(CLASSES) for item in sorted(found[split, cls])]
        images = np.stack([_decode(name, payload) for _, name, payload in items])
        arrays += [_hwc_to_chw(images), torch.tensor([c for c, *_ in items])]
    return Cifar10(*arrays, name=f"CIFAR-10 image folder ({source.name})")


def _cache_path(source: Path, cache_dir: Path | None, limit: int | None) -> Path:
    """Keyed on every image's size and mtime in a folder (the folder's own mtime moves whenever
    a cache is written into it), on the tarball's for a tarball."""
    if source.is_dir():
        images = (f for f in sorted(source.rglob("*")) if _split_member(str(f.relative_to(source))))
        stamp = "|".join(f"{f.relative_to(source)}:{s.st_size}:{s.st_mtime_ns}"
                         for f, s in ((f, f.stat()) for f in images))
    else:
        stamp = f"{source.stat().st_size}:{source.stat().st_mtime_ns}"
    # a limit once cut the test split too: such caches must not be read as today's
    cut = limit if limit is None else f"{limit} training images"
    key = hashlib.sha256(f"{source.resolve()}|{cut}|{stamp}".encode()).hexdigest()[:16]
    folder = cache_dir or (source if source.is_dir() else source.parent)
    return folder / f".{source.name}.{key}.npz"


def _read_cache(path: Path) -> list[torch.Tensor] | None:
    """The four cached arrays; None when missing or damaged, so the caller decodes again."""
    try:
        with np.load(path) as z:
            return [torch.from_numpy(z[k]) for k in _ARRAYS]
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile):
        return None


def _write_cache(path: Path, data: Cifar10) -> None:
    """Under a unique temporary name, then renamed: several ranks may write it at once."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, **{k: getattr(data, k).numpy() for k in _ARRAYS})
            os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide a shared cache from other users
            os.replace(tmp, path)  # readers see no cache or a whole one, never part of one
        finally:
            Path(tmp).unlink(missing_ok=True)  # gone already unless something failed
    except OSError as err:  # e.g. a read-only folder: decoding again next time beats failing
        warnings.warn(f"not caching the decoded images in {path.parent} ({err}); "
                      "pass a writable cache_dir to keep them", stacklevel=3)


def load_cifar10(
    source: str | Path = "auto", limit_per_class: int | None = None, cache_dir: Path | None = None
) -> Cifar10:
    """CIFAR-10 from ``source``, optionally only the first ``limit_per_class`` training images
    of each class; ``cache_dir`` is where a decoded image folder is kept.

    ``source``: ``auto`` (torchvision's copy in ./data, downloaded when missing), ``synthetic``,
    a torchvision-layout folder, an image-folder tree, or a .tar/.tar.gz of one.
    """
    if source == "synthetic":
        return first_per_class(synthetic_cifar10(), limit_per_class)
    path = Path("data") if source == "auto" else Path(source)
    if path.name == "cifar-10-batches-py":
        path = path.parent
    if (path / "cifar-10-batches-py").is_dir() or source == "auto":
        data = _from_torchvision(path, download=not (path / "cifar-10-batches-py").is_dir())
        return first_per_class(data, limit_per_class)
    if not path.exists():
        raise DataError(f"--data {source}: no such file or folder; {_PASS}")
    cache = _cache_path(path, cache_dir, limit_per_class)
    cached = _read_cache(cache)
    if cached is not None:
        return Cifar10(*cached, name=f"CIFAR-10 image folder ({path.name})")
    data = _decode_image_folder(path, limit_per_class)
    _write_cache(cache, data)
    return data
