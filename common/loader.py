"""Batches of this rank's shard, augmented and normalised on the training device.

CIFAR-100 and TinyImageNet are held in memory as uint8 and moved to the device once; each
training batch is cropped, flipped and normalised there as one tensor (`DeviceLoader`): no
per-sample PIL work in the loop, which is what makes the public solutions' GPUs wait.  An
ImageNet-layout folder does not fit in memory, so its JPEGs are decoded and augmented per
sample by --workers processes (`FolderLoader`), which hand uint8 tensors to the device.
"""
import math

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from .data import IMAGENET_MEAN, IMAGENET_STD, SPECS, ImageSet


def normalization(dataset, pretrained=False):
    """(mean, std): the data set's own; ImageNet's for ImageNet weights (the statistics the
    pretrained filters expect) and for image folders.  Training and test batches alike."""
    if pretrained or dataset not in SPECS:
        return IMAGENET_MEAN, IMAGENET_STD
    return SPECS[dataset].mean, SPECS[dataset].std


class ShardedLoader:
    """This rank's share of a data set, in batches, finished on the training device.

    Training: a DistributedSampler gives this rank its shard of a permutation that changes
    every epoch.  Test: this rank's samples are ``rank::world_size``, unpadded, so that summing
    over ranks counts each test sample exactly once.  `finish` normalises a uint8 batch on the
    device (and resizes it to `image_size`, and makes it channels_last, if asked)."""
    DROPOUT, SAMPLE, AUGMENT = 1, 2, 3  # what a seed is for, beside a batch's crops (`seed_for`)

    def __init__(self, size, batch_size, device, *, train, mean, std, rank=0, world_size=1,
                 seed=0, image_size=None, channels_last=False):
        self.batch_size, self.device = batch_size, torch.device(device)
        self.rank, self.seed, self.epoch = rank, seed, 0
        self.image_size, self.channels_last = image_size, channels_last
        std = torch.tensor(std, device=device).view(1, 3, 1, 1)
        self.scale = 1.0 / (255.0 * std)
        self.shift = -torch.tensor(mean, device=device).view(1, 3, 1, 1) / std
        self.sampler = DistributedSampler(range(size), num_replicas=world_size, rank=rank,
                                          shuffle=True, seed=seed) if train else \
            range(rank, size, world_size)  # test: rank::world_size, unpadded

    def set_epoch(self, epoch):
        """A new permutation (and new crops and flips) for `epoch`."""
        self.epoch = epoch
        if isinstance(self.sampler, DistributedSampler):
            self.sampler.set_epoch(epoch)

    def epoch_batches(self, epoch, start=0):
        """Epoch `epoch`'s batches from batch `start` on (a resumed epoch skips the others): batch
        k's samples, crops, flips and dropout masks from (seed, epoch, rank, k) alone."""
        self.set_epoch(epoch)
        for k, batch in enumerate(self.batches(start), start):
            torch.manual_seed(self.seed_for(k, self.DROPOUT))  # the masks its forward pass draws
            yield batch

    def seed_for(self, *place):
        """A seed from (--seed, epoch, rank) and `place` alone: (k,) for batch k's crops, (k,
        DROPOUT) for its dropout masks, (i, SAMPLE) for the i-th sample of an image folder."""
        return hash((self.seed, self.epoch, self.rank, *place)) % 2**63

    def __len__(self):
        return math.ceil(len(self.sampler) / self.batch_size)  # no permutation drawn

    def __iter__(self):
        return self.batches()

    def finish(self, x):
        x = x.float() * self.scale + self.shift
        if self.image_size and self.image_size != x.shape[-1]:
            x = F.interpolate(x, size=(self.image_size, self.image_size), mode="bilinear",
                              align_corners=False)
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x


class DeviceLoader(ShardedLoader):
    """Batches of an in-memory ImageSet, held and augmented on the training device: each
    training image gets its own random crop with zero padding (`pad`, default 1/8 of the side)
    and horizontal flip, then with `auto_augment="ta_wide"` TrivialAugment; test batches are
    only normalised."""

    def __init__(self, data, batch_size, device, *, train, pad=None, augment=None,
                 auto_augment="none", **shard):
        super().__init__(len(data), batch_size, device, train=train, **shard)
        self.images, self.labels = data.images.to(device), data.labels.to(device)
        self.augment = train if augment is None else augment
        self.pad = data.images.shape[-1] // 8 if pad is None else pad
        self.trivial_augment = None  # torchvision's TrivialAugmentWide, imported only if asked
        if self.augment and auto_augment == "ta_wide":
            from torchvision.transforms import v2
            self.trivial_augment = v2.TrivialAugmentWide()

    def batches(self, start=0):
        order = torch.tensor(list(self.sampler), dtype=torch.int64, device=self.device)
        gen = torch.Generator(self.device) if self.augment else None
        for k in range(start, len(self)):
            idx = order[k * self.batch_size:(k + 1) * self.batch_size]
            x = self.images[idx]
            if self.augment:
                gen.manual_seed(self.seed_for(k))
                x = random_crop_flip(x, self.pad, gen)
            if self.trivial_augment is not None:  # one operation and strength per 8 images,
                # drawn from the global generator (`epoch_batches` seeds it again after)
                torch.manual_seed(self.seed_for(k, self.AUGMENT))
                x = torch.cat([self.trivial_augment(part) for part in x.split(8)])
            yield self.finish(x), self.labels[idx]


def random_crop_flip(x, pad, gen):
    """Per-sample random crop (zero padding `pad`) and horizontal flip of a uint8 batch: what
    torchvision's RandomCrop(size, padding=pad) + RandomHorizontalFlip() do, as two gathers."""
    b, c, h, w = x.shape
    dev = x.device
    padded = F.pad(x, (pad, pad, pad, pad))
    dy = torch.randint(0, 2 * pad + 1, (b, 1), device=dev, generator=gen)
    dx = torch.randint(0, 2 * pad + 1, (b, 1), device=dev, generator=gen)
    flip = torch.rand((b, 1), device=dev, generator=gen) < 0.5
    rows = dy + torch.arange(h, device=dev)
    cols = dx + torch.arange(w, device=dev)
    cols = torch.where(flip, cols.flip(1), cols)
    x = padded.gather(2, rows.view(b, 1, h, 1).expand(b, c, h, w + 2 * pad))
    return x.gather(3, cols.view(b, 1, 1, w).expand(b, c, h, w))


class FolderLoader(ShardedLoader):
    """Batches of an ImageFolder (data.read_imagefolder: its transforms crop and flip), this
    rank's shard, decoded by `workers` processes; `finish` normalises them on the device."""

    def __init__(self, dataset, batch_size, device, *, train, workers=4, **shard):
        super().__init__(len(dataset), batch_size, device, train=train, **shard)
        self.dataset, self.workers = dataset, workers

    def batches(self, start=0):
        """Each sample's crop and flip from (seed, epoch, rank, its place) alone (`SeededItems`)."""
        keyed = [(self.seed_for(j, self.SAMPLE), i) for j, i in enumerate(self.sampler)]
        loader = DataLoader(SeededItems(self.dataset), batch_size=self.batch_size,
                            sampler=keyed[start * self.batch_size:], num_workers=self.workers,
                            pin_memory=self.device.type == "cuda")
        for images, labels in loader:
            images = images.to(self.device, non_blocking=True)
            yield self.finish(images), labels.to(self.device, non_blocking=True)


class SeededItems(torch.utils.data.Dataset):
    """Item (seed, i): `dataset[i]`, its random transforms drawn after torch.manual_seed(seed)."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __getitem__(self, key):
        torch.manual_seed(key[0])
        return self.dataset[key[1]]


def make_loader(data, args, run, *, train, batch_size=None, rank=0, world_size=1,
                pretrained=False):
    """This rank's shard of `data`, in batches of `batch_size` (default --batch-size; the test
    set's at least 256), normalised as `normalization(args.dataset, pretrained)` says."""
    mean, std = normalization(args.dataset, pretrained)
    batch_size = batch_size or (args.batch_size if train else max(args.batch_size, 256))
    shard = dict(train=train, mean=mean, std=std, rank=rank, world_size=world_size,
                 seed=args.seed, channels_last=run.amp)
    if isinstance(data, ImageSet):
        return DeviceLoader(data, batch_size, run.device, image_size=args.image_size,
                            auto_augment=args.auto_augment, **shard)
    return FolderLoader(data, batch_size, run.device, workers=args.workers, **shard)

