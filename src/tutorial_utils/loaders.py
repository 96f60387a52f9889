"""Two ways to feed CIFAR-10 to a training loop.

:class:`DeviceLoader` keeps the uint8 images on the training device (150 MB for all of CIFAR-10)
and crops and flips whole batches there, so no CPU worker sits on the critical path;
:func:`dataloader` is the classic ``DataLoader`` + ``DistributedSampler`` route, its crops and
flips a function of (seed, epoch, sample) so that a resumed run repeats them.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.utils.data.distributed import DistributedSampler

MEAN = (0.4914, 0.4822, 0.4465)  # the official training-set statistics
STD = (0.2470, 0.2435, 0.2616)


@functools.cache
def _mean_std(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # Made once per device: torch.tensor(..., device="cuda") copies from ordinary host memory
    # and waits until the GPU has finished all the work queued before it, a stall per batch.
    return (torch.tensor(MEAN, device=device).view(1, 3, 1, 1),
            torch.tensor(STD, device=device).view(1, 3, 1, 1))


def normalize(x: torch.Tensor, channels_last: bool = False) -> torch.Tensor:
    """uint8 images -> float32 with CIFAR-10 mean and std removed."""
    mean, std = _mean_std(x.device)
    out = (x.float() / 255 - mean) / std
    return out.contiguous(memory_format=torch.channels_last) if channels_last else out


def random_crop_flip(
    x: torch.Tensor, generator: torch.Generator | None = None, pad: int = 4
) -> torch.Tensor:
    """Per-image random crop from a ``pad``-pixel zero-padded copy, and random horizontal flip.

    Works on a whole batch at once on any device: one padded copy, then a gather.
    """
    n, _, h, w = x.shape
    padded = F.pad(x, (pad, pad, pad, pad))
    dy = torch.randint(0, 2 * pad + 1, (n, 1, 1), device=x.device, generator=generator)
    dx = torch.randint(0, 2 * pad + 1, (n, 1, 1), device=x.device, generator=generator)
    flip = torch.rand(n, 1, 1, device=x.device, generator=generator) < 0.5
    rows = dy + torch.arange(h, device=x.device).view(1, h, 1)
    cols = torch.arange(w, device=x.device).view(1, 1, w)
    cols = dx + torch.where(flip, w - 1 - cols, cols)
    batch = torch.arange(n, device=x.device).view(n, 1, 1)
    return padded[batch, :, rows, cols].permute(0, 3, 1, 2)  # advanced indexing puts C last


class DeviceLoader:
    """Batches from data resident on ``device``; each rank takes its shard of one permutation.

    Every rank draws the same per-epoch permutation from ``seed + epoch``, takes every
    ``world_size``-th index from position ``rank``, and drops the tail so all ranks run the
    same number of steps.
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch: int, *, device: torch.device,
                 rank: int = 0, world_size: int = 1, train: bool = True, seed: int = 0,
                 channels_last: bool = False, crop_pad: int = 4) -> None:
        self.x, self.y = x.to(device), y.to(device)
        self.batch, self.device, self.rank, self.world = batch, device, rank, world_size
        self.train, self.seed, self.channels_last = train, seed, channels_last
        self.crop_pad = crop_pad
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _indices(self) -> torch.Tensor:
        n = len(self.x)
        if not self.train:  # evaluation: every sample exactly once across ranks
            return torch.arange(self.rank, n, self.world, device=self.device)
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        perm = torch.randperm(n, generator=g).to(self.device)
        per_rank = n // self.world // self.batch * self.batch
        return perm[self.rank :: self.world][:per_rank]

    def __len__(self) -> int:
        n = len(self.x)
        if not self.train:
            return -(-len(range(self.rank, n, self.world)) // self.batch)
        return n // self.world // self.batch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        idx = self._indices()
        g = None
        if self.train:  # augmentation randomness depends on (seed, epoch, rank) only
            g = torch.Generator(device=self.device)
            g.manual_seed(self.seed * 1_000_003 + self.epoch * 1009 + self.rank)
        for i in range(0, len(idx), self.batch):
            b = idx[i : i + self.batch]
            x = self.x[b]
            if self.train:
                x = random_crop_flip(x, g, self.crop_pad)
            yield normalize(x, self.channels_last), self.y[b]


class _AugmentedImages(torch.utils.data.Dataset):
    """Crops and flips drawn from (seed, epoch, sample index) alone, so that they repeat exactly
    on resuming, whatever the number of worker processes."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, crop_pad: int, seed: int) -> None:
        self.x, self.y, self.crop_pad, self.seed = x, y, crop_pad, seed
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, item: int | tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        # the sampler sends (epoch, index): persistent workers keep their own copy of this
        # dataset, which set_epoch in the main process never reaches
        epoch, i = item if isinstance(item, tuple) else (self.epoch, item)
        key = hashlib.blake2b(f"{self.seed},{epoch},{i}".encode(), digest_size=8).digest()
        g = torch.Generator().manual_seed(int.from_bytes(key, "little"))
        return random_crop_flip(self.x[i : i + 1], g, self.crop_pad)[0], self.y[i]


class _EpochSampler(DistributedSampler):
    def __iter__(self) -> Iterator[tuple[int, int]]:
        return ((self.epoch, i) for i in super().__iter__())


class _EpochLoader(torch.utils.data.DataLoader):
    def set_epoch(self, epoch: int) -> None:
        """A new shuffle and new crops and flips."""
        self.sampler.set_epoch(epoch)
        self.dataset.epoch = epoch


def dataloader(x: torch.Tensor, y: torch.Tensor, batch: int, *, rank: int = 0,
               world_size: int = 1, seed: int = 0, workers: int = 4,
               pin_memory: bool = True, crop_pad: int = 4) -> _EpochLoader:
    """The classic training route: CPU workers augment single images, a sampler shards them.

    Batches are uint8; the training loop copies them to the GPU and normalises them there.
    Call ``loader.set_epoch(epoch)`` (or ``loader.sampler.set_epoch``) before each epoch.
    """
    dataset = _AugmentedImages(x, y, crop_pad, seed)
    sampler = _EpochSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True,
                            seed=seed, drop_last=True)
    # A generator of its own: each new iterator draws its workers' base seed from it, not
    # from the global RNG, whose draws (dropout) a resumed run must repeat exactly. The
    # persistent workers start once per process, so a resumed process draws at another epoch.
    return _EpochLoader(
        dataset, batch_size=batch, sampler=sampler, num_workers=workers,
        pin_memory=pin_memory, drop_last=True, persistent_workers=workers > 0,
        generator=torch.Generator().manual_seed(seed),
    )
