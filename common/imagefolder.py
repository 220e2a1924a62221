"""An ImageNet-layout folder (train/<class>/*, val/<class>/*), decoded in DataLoader workers.

ImageNet does not fit in memory, so unlike CIFAR and TinyImageNet its JPEGs are decoded and
augmented per sample -- in `--workers` processes, in parallel with training -- with the
standard recipe: random-resized crop + flip for training, resize to 256/224 of the crop and
center crop for validation.  Workers hand over uint8 tensors; normalisation (ImageNet's mean
and std) and the channels_last layout happen on the device, which moves 4x fewer bytes.
"""
import math
import os

import torch
from torch.utils.data import DataLoader, DistributedSampler

from .errors import UserError


def read_imagefolder(data_dir, image_size):
    """(train, val) torchvision ImageFolder datasets with the ImageNet transforms."""
    from torchvision import datasets, transforms
    for split in ("train", "val"):
        if not os.path.isdir(os.path.join(data_dir, split)):
            raise UserError(f"image folder not found: expected {os.path.join(data_dir, split)}/"
                            "<class>/*.JPEG (the ImageNet layout); point --data-dir at it")
    resize = int(round(image_size * 256 / 224))
    train = transforms.Compose([transforms.RandomResizedCrop(image_size),
                                transforms.RandomHorizontalFlip(), transforms.PILToTensor()])
    val = transforms.Compose([transforms.Resize(resize), transforms.CenterCrop(image_size),
                              transforms.PILToTensor()])
    train_set = datasets.ImageFolder(os.path.join(data_dir, "train"), transform=train)
    val_set = datasets.ImageFolder(os.path.join(data_dir, "val"), transform=val)
    if val_set.classes != train_set.classes:
        raise UserError(f"{data_dir}: val/ and train/ hold different class folders")
    return train_set, val_set


class FolderLoader:
    """Batches of an ImageFolder: this rank's shard, decoded by workers, finished on the device.

    The same interface as `data.DeviceLoader` (set_epoch, len, batches(start)).
    """

    def __init__(self, dataset, batch_size, device, *, train, mean, std, rank=0, world_size=1,
                 seed=0, workers=4, channels_last=False):
        self.dataset, self.batch_size, self.device = dataset, batch_size, torch.device(device)
        self.train, self.rank, self.world_size, self.seed = train, rank, world_size, seed
        self.workers, self.channels_last, self.epoch = workers, channels_last, 0
        std = torch.tensor(std, device=device).view(1, 3, 1, 1)
        self.scale = 1.0 / (255.0 * std)
        self.shift = -torch.tensor(mean, device=device).view(1, 3, 1, 1) / std
        if train:
            self.sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank,
                                              shuffle=True, seed=seed)
            self.num_samples = self.sampler.num_samples
        else:
            self.sampler = None
            self.num_samples = len(range(rank, len(dataset), world_size))

    def set_epoch(self, epoch):
        self.epoch = epoch
        if self.sampler is not None:
            self.sampler.set_epoch(epoch)

    def __len__(self):
        return math.ceil(self.num_samples / self.batch_size)

    def __iter__(self):
        return self.batches()

    def batches(self, start=0):
        indices = list(self.sampler) if self.sampler is not None else \
            list(range(self.rank, len(self.dataset), self.world_size))
        indices = indices[start * self.batch_size:]
        generator = torch.Generator().manual_seed(
            hash((self.seed, self.epoch, self.rank, start)) % 2**63)
        loader = DataLoader(self.dataset, batch_size=self.batch_size, sampler=indices,
                            num_workers=self.workers, pin_memory=self.device.type == "cuda",
                            generator=generator, persistent_workers=False)
        for images, labels in loader:
            images = images.to(self.device, non_blocking=True)
            images = images.float() * self.scale + self.shift
            if self.channels_last:
                images = images.contiguous(memory_format=torch.channels_last)
            yield images, labels.to(self.device, non_blocking=True)
