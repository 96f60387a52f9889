import os
import pickle
import shutil
import tarfile
import urllib.error
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tutorial_utils.data import CLASSES, DataError, load_cifar10, synthetic_cifar10
from tutorial_utils.loaders import DeviceLoader, dataloader, normalize, random_crop_flip

# ../shared beside the main checkout; a worktree sits one or more folders deeper
SHARED_TARBALL = next(
    (p / "shared/data/cifar10-jpeg.tar.gz" for p in Path(__file__).resolve().parents[1:]
     if (p / "shared/data/cifar10-jpeg.tar.gz").exists()),
    Path("shared/data/cifar10-jpeg.tar.gz"),
)


@pytest.fixture
def image_tree(tmp_path):
    """train/<class>/k.png (2 per class) and test/<class>/k.png (1 per class): colour = class."""
    root = tmp_path / "tree"
    for split, n in (("train", 2), ("test", 1)):
        for c, name in enumerate(CLASSES):
            (root / split / name).mkdir(parents=True)
            for k in range(n):
                pixels = np.full((32, 32, 3), c * 20 + k, dtype=np.uint8)
                Image.fromarray(pixels).save(root / split / name / f"{k:04d}.png")
    return root


def tar_of(tree: Path, path: Path) -> Path:
    """``tree`` packed as ``cifar/...`` into ``path``, compressed if it ends in .gz."""
    with tarfile.open(path, "w:gz" if path.suffix == ".gz" else "w") as tar:
        tar.add(tree, arcname="cifar")
    return path


def data_error(source: Path | str, tmp_path: Path, *words: str) -> str:
    """The one-line DataError that loading ``source`` gives; it contains every word."""
    with pytest.raises(DataError) as err:
        load_cifar10(source, cache_dir=tmp_path / "cache")
    msg = str(err.value)
    assert "\n" not in msg, msg
    for word in words:
        assert word in msg, msg
    return msg


def test_synthetic_is_labelled_as_such():
    d = synthetic_cifar10(100, 20)
    assert d.synthetic and "synthetic" in d.name
    assert d.train_x.shape == (100, 3, 32, 32) and d.train_x.dtype == torch.uint8
    assert d.test_y.shape == (20,)


def test_image_folder_tree_decodes_in_class_order(image_tree, tmp_path):
    d = load_cifar10(image_tree, cache_dir=tmp_path)
    assert not d.synthetic
    assert d.train_x.shape == (20, 3, 32, 32) and d.test_x.shape == (10, 3, 32, 32)
    assert d.train_y.tolist() == [c for c in range(10) for _ in range(2)]
    assert d.train_x[2:4, 0, 0, 0].tolist() == [20, 21]  # class 1, images 0 and 1


def no_decoding(monkeypatch):
    monkeypatch.setattr(Image, "open", lambda *a, **k: pytest.fail("decoded again"))


@pytest.mark.parametrize("name", ["c.tar.gz", "c.tar"])
def test_tarball_equals_tree_and_is_cached(image_tree, tmp_path, monkeypatch, name):
    tarball = tar_of(image_tree, tmp_path / name)
    first = load_cifar10(tarball, cache_dir=tmp_path / "cache")
    assert torch.equal(first.train_x, load_cifar10(image_tree, cache_dir=tmp_path).train_x)
    no_decoding(monkeypatch)
    again = load_cifar10(tarball, cache_dir=tmp_path / "cache")
    assert torch.equal(again.test_x, first.test_x) and torch.equal(again.test_y, first.test_y)


def test_limit_per_class_keeps_the_first_images(image_tree, tmp_path):
    d = load_cifar10(image_tree, 1, tmp_path)
    assert d.train_y.tolist() == list(range(10)) and d.train_x[:, 0, 0, 0].tolist()[:2] == [0, 20]


def test_limit_per_class_cuts_the_training_images_only_from_every_source(image_tree, tmp_path):
    for split in ("train", "test"):  # two images per class in each split
        for name in CLASSES:
            Image.fromarray(np.full((32, 32, 3), 7, np.uint8)).save(
                image_tree / split / name / "0009.png")
    folder = load_cifar10(image_tree, 1, tmp_path)
    synthetic = load_cifar10("synthetic", limit_per_class=1)
    assert len(folder.train_y) == len(synthetic.train_y) == 10
    assert len(folder.test_y) == 20  # every test image, as from torchvision's copy
    assert len(synthetic.test_y) == len(load_cifar10("synthetic").test_y)


def test_a_second_load_of_a_folder_decodes_nothing(image_tree, monkeypatch):
    first = load_cifar10(str(image_tree))  # the cache goes into the folder itself
    no_decoding(monkeypatch)
    again = load_cifar10(str(image_tree))
    assert torch.equal(again.train_x, first.train_x) and torch.equal(again.test_y, first.test_y)


def test_a_changed_image_is_decoded_again(image_tree, tmp_path):
    load_cifar10(str(image_tree), cache_dir=tmp_path)
    Image.fromarray(np.full((32, 32, 3), 201, np.uint8)).save(image_tree / "test/cat/0000.png")
    d = load_cifar10(str(image_tree), cache_dir=tmp_path)
    assert d.test_x[CLASSES.index("cat"), 0, 0, 0] == 201


def test_loads_racing_to_write_the_cache_all_succeed(image_tree, tmp_path, monkeypatch):
    real_replace = os.replace

    def another_load_first(src, dst):  # a second rank loads start to finish in between
        monkeypatch.setattr(os, "replace", real_replace)
        load_cifar10(str(image_tree), cache_dir=tmp_path / "cache")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", another_load_first)
    d = load_cifar10(str(image_tree), cache_dir=tmp_path / "cache")
    assert d.train_x.shape == (20, 3, 32, 32)
    assert len(list((tmp_path / "cache").iterdir())) == 1  # one cache, no temporary files left
    no_decoding(monkeypatch)
    load_cifar10(str(image_tree), cache_dir=tmp_path / "cache")


def test_an_unwritable_cache_folder_only_costs_the_cache(image_tree, tmp_path):
    (tmp_path / "taken").write_text("a file where the cache folder would go")
    with pytest.warns(UserWarning, match="taken"):
        d = load_cifar10(str(image_tree), cache_dir=tmp_path / "taken")
    assert d.test_x.shape == (10, 3, 32, 32)


@pytest.mark.skipif(not SHARED_TARBALL.exists(), reason="no shared JPEG copy")
def test_slice_of_the_jpeg_copy(tmp_path):
    d = load_cifar10(str(SHARED_TARBALL), cache_dir=tmp_path, limit_per_class=5)
    assert d.train_x.shape == (50, 3, 32, 32) and d.test_x.shape == (10000, 3, 32, 32)
    assert d.train_y.bincount().tolist() == [5] * 10
    assert 0.3 < d.train_x.float().mean().item() / 255 < 0.6


def test_folder_without_images_is_a_clear_error(tmp_path):
    (tmp_path / "empty").mkdir()
    data_error(tmp_path / "empty", tmp_path, "train/ missing", "test/ missing")


def test_missing_path_is_a_clear_error(tmp_path):
    data_error(tmp_path / "nope.tar.gz", tmp_path, "nope.tar.gz", "no such file or folder")


def test_synthetic_only_when_asked():
    assert load_cifar10("synthetic").synthetic


def torchvision_layout(root: Path, n: int = 20) -> Path:
    """A small ``cifar-10-batches-py`` under ``root``: batch b holds n images of value b."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    for b, name in enumerate([f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]):
        batch = {"data": np.full((n, 3072), b, np.uint8), "labels": [k % 10 for k in range(n)]}
        (folder / name).write_bytes(pickle.dumps(batch))
    (folder / "batches.meta").write_bytes(pickle.dumps({"label_names": list(CLASSES)}))
    return root


@pytest.fixture
def unverified(monkeypatch):
    """torchvision checks its files' MD5 sums, which a stand-in copy cannot match."""
    monkeypatch.setattr("torchvision.datasets.cifar.check_integrity", lambda *a, **k: True)
    monkeypatch.setattr("torchvision.datasets.CIFAR10.download",
                        lambda self: pytest.fail("downloaded although present"))


def test_auto_takes_torchvisions_copy_under_data(tmp_path, monkeypatch, unverified):
    torchvision_layout(tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    d = load_cifar10()
    assert d.train_x.shape == (100, 3, 32, 32) and d.test_x.shape == (20, 3, 32, 32)
    assert d.test_x.unique().tolist() == [5] and not d.synthetic


def test_a_torchvision_layout_folder_is_a_source(tmp_path, unverified):
    d = load_cifar10(torchvision_layout(tmp_path / "elsewhere"))
    assert d.train_y.tolist()[:12] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1]


def test_a_damaged_torchvision_folder_is_named(tmp_path):
    (tmp_path / "tv/cifar-10-batches-py").mkdir(parents=True)
    data_error(tmp_path / "tv", tmp_path, "tv/cifar-10-batches-py", "download")


def test_auto_offline_without_data_says_what_to_pass(tmp_path, monkeypatch):
    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr("torchvision.datasets.CIFAR10.download", offline)
    monkeypatch.chdir(tmp_path)
    msg = data_error("auto", tmp_path, str(tmp_path / "data"), "URLError", "--data", "tarball",
                     "download")
    assert "--data-dir" not in msg  # the option is gone


def test_a_file_that_is_no_archive_is_named(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("not a tarball\n")
    data_error(notes, tmp_path, str(notes), "not a .tar", "--data")


def test_an_empty_file_is_named(tmp_path):
    empty = tmp_path / "cifar.tar.gz"
    empty.touch()
    data_error(empty, tmp_path, str(empty), "empty", "again")


@pytest.mark.parametrize("name", ["c.tar.gz", "c.tar"])
def test_a_truncated_archive_is_named(image_tree, tmp_path, name):
    whole = tar_of(image_tree, tmp_path / name).read_bytes()
    cut = tmp_path / f"cut-{name}"
    cut.write_bytes(whole[: len(whole) // 2])
    data_error(cut, tmp_path, str(cut), "truncated", "again")


def test_a_tar_cut_between_two_members_is_truncated_too(image_tree, tmp_path):
    tarball = tar_of(image_tree, tmp_path / "c.tar")
    with tarfile.open(tarball) as tar:
        last = tar.getmembers()[-1]  # the second image of a class: every class is still there
    cut = tmp_path / "cut.tar"
    cut.write_bytes(tarball.read_bytes()[: last.offset])
    data_error(cut, tmp_path, str(cut), "truncated")


def test_a_damaged_image_in_a_good_archive_is_named(image_tree, tmp_path):
    png = image_tree / "train/cat/0001.png"
    png.write_bytes(png.read_bytes()[:60])
    tarball = tar_of(image_tree, tmp_path / "c.tar.gz")
    data_error(tarball, tmp_path, str(tarball), "cifar/train/cat/0001.png", "replace or remove")


def test_an_image_of_another_size_is_named(image_tree, tmp_path):
    Image.fromarray(np.zeros((28, 32, 3), np.uint8)).save(image_tree / "test/dog/0000.png")
    data_error(image_tree, tmp_path, "test/dog/0000.png", "32x28", "32x32")


def test_a_damaged_cache_is_rebuilt_silently(image_tree, tmp_path, monkeypatch):
    first = load_cifar10(str(image_tree), cache_dir=tmp_path / "cache")
    for cache in (tmp_path / "cache").iterdir():
        cache.write_bytes(cache.read_bytes()[:300])
    again = load_cifar10(str(image_tree), cache_dir=tmp_path / "cache")
    assert torch.equal(again.train_x, first.train_x) and torch.equal(again.test_y, first.test_y)
    no_decoding(monkeypatch)
    load_cifar10(str(image_tree), cache_dir=tmp_path / "cache")


def test_a_missing_or_misspelled_class_is_named(image_tree, tmp_path):
    shutil.rmtree(image_tree / "test/ship")
    (image_tree / "train/truck").rename(image_tree / "train/trucks")
    msg = data_error(image_tree, tmp_path, str(image_tree), "test/ship missing",
                     "train/truck missing")
    assert "trucks" in msg  # the misspelt folder, among those found


def test_a_missing_split_is_named(image_tree, tmp_path):
    shutil.rmtree(image_tree / "test")
    data_error(tar_of(image_tree, tmp_path / "c.tar.gz"), tmp_path, "c.tar.gz", "test/ missing")


def test_crop_and_flip_match_a_per_image_reference():
    x = torch.randint(0, 256, (6, 3, 8, 8), dtype=torch.uint8)
    out = random_crop_flip(x, torch.Generator().manual_seed(3), pad=2)
    g = torch.Generator().manual_seed(3)  # the same draws, in the same order
    dy = torch.randint(0, 5, (6, 1, 1), generator=g).flatten()
    dx = torch.randint(0, 5, (6, 1, 1), generator=g).flatten()
    flip = (torch.rand(6, 1, 1, generator=g) < 0.5).flatten()
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2))
    for i in range(6):
        crop = padded[i, :, dy[i] : dy[i] + 8, dx[i] : dx[i] + 8]
        expected = crop.flip(-1) if flip[i] else crop
        assert torch.equal(out[i], expected)
    assert out.dtype == torch.uint8 and out.shape == x.shape


def test_device_loader_shards_one_permutation_across_ranks():
    x = torch.arange(100, dtype=torch.uint8).view(100, 1, 1, 1).expand(100, 3, 32, 32)
    y = torch.arange(100)
    seen = []
    for rank in range(2):
        loader = DeviceLoader(x, y, 16, device=torch.device("cpu"), rank=rank, world_size=2)
        loader.set_epoch(1)
        labels = torch.cat([b[1] for b in loader])
        assert len(loader) == 3 and len(labels) == 48
        seen.append(set(labels.tolist()))
    assert not seen[0] & seen[1]


def test_device_loader_without_crop_padding_only_mirrors():
    x = torch.randint(0, 256, (32, 3, 8, 8), dtype=torch.uint8)
    loader = DeviceLoader(x, torch.arange(32), 32, device=torch.device("cpu"), crop_pad=0)
    ((xb, yb),) = list(loader)
    originals = normalize(x[yb])
    same = [torch.equal(a, b) for a, b in zip(xb, originals, strict=True)]
    mirrored = [torch.equal(a, b.flip(-1)) for a, b in zip(xb, originals, strict=True)]
    assert all(s or m for s, m in zip(same, mirrored, strict=True))
    assert 0 < sum(same) < 32


def test_device_loader_eval_covers_every_sample_once():
    x = torch.zeros(103, 3, 32, 32, dtype=torch.uint8)
    y = torch.arange(103)
    labels = []
    for rank in range(3):
        loader = DeviceLoader(x, y, 10, device=torch.device("cpu"), rank=rank, world_size=3,
                              train=False)
        labels += torch.cat([b[1] for b in loader]).tolist()
    assert sorted(labels) == list(range(103))


def test_classic_dataloader_yields_uint8_batches():
    d = synthetic_cifar10(64, 8)
    loader = dataloader(d.train_x, d.train_y, 16, rank=1, world_size=2, workers=0,
                        pin_memory=False)
    batches = list(loader)
    assert len(batches) == 2 and batches[0][0].shape == (16, 3, 32, 32)
    assert batches[0][0].dtype == torch.uint8


def test_dataloader_augments_by_seed_epoch_and_sample_alone():
    x = torch.randint(0, 256, (64, 3, 32, 32), dtype=torch.uint8,
                      generator=torch.Generator().manual_seed(0))
    y = torch.arange(64)

    def batches(loader, epoch):
        loader.set_epoch(epoch)
        return [(xb.clone(), yb.clone()) for xb, yb in loader]

    def same(a, b):
        return all(torch.equal(p, q) for pa, pb in zip(a, b, strict=True)
                   for p, q in zip(pa, pb, strict=True))

    def by_sample(batches):
        xs, ys = map(torch.cat, zip(*batches, strict=True))
        return xs[ys.argsort()]

    def make(workers):
        return dataloader(x, y, 16, seed=7, workers=workers, pin_memory=False)

    inline, workers = make(0), make(2)
    first = batches(inline, 0)
    assert same(batches(workers, 0), first)
    second = batches(workers, 1)  # the same (persistent) worker processes, one epoch on
    assert same(batches(inline, 1), second) and same(batches(make(2), 1), second)  # resumed
    assert not torch.equal(by_sample(first), by_sample(second))  # new crops and flips
