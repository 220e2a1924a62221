"""An ImageNet-layout folder (train/<class>/*, val/<class>/*), decoded in DataLoader workers.

ImageNet does not fit in memory, so unlike CIFAR and TinyImageNet its JPEGs are decoded and
augmented per sample -- in `--workers` processes, in parallel with training -- with the
standard recipe: random-resized crop + flip for training, resize to 256/224 of the crop and
center crop for validation.  Workers hand over uint8 tensors; normalisation (ImageNet's mean
and std) and the channels_last layout happen on the device, which moves 4x fewer bytes.
"""
import os

import torch
from torch.utils.data import DataLoader

from .data import ShardedLoader, balanced_indices
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


def limit_imagefolder(dataset, n, seed):
    """Keep `n` samples of an ImageFolder, balanced over the classes (`balanced_indices`)."""
    keep = balanced_indices(dataset.targets, n, seed) if len(dataset) else None
    if keep is not None:
        dataset.samples = [dataset.samples[i] for i in keep.tolist()]
        dataset.targets = [label for _, label in dataset.samples]
        dataset.imgs = dataset.samples
    return dataset


class FolderLoader(ShardedLoader):
    """Batches of an ImageFolder: this rank's shard, decoded by `workers` processes.

    Workers hand over uint8 tensors; `finish` normalises them on the device.
    """

    def __init__(self, dataset, batch_size, device, *, train, workers=4, **shard):
        super().__init__(len(dataset), batch_size, device, train=train, **shard)
        self.dataset, self.workers = dataset, workers

    def batches(self, start=0):
        indices = self.indices()[start * self.batch_size:]
        generator = torch.Generator().manual_seed(
            hash((self.seed, self.epoch, self.rank, start)) % 2**63)
        loader = DataLoader(self.dataset, batch_size=self.batch_size, sampler=indices,
                            num_workers=self.workers, pin_memory=self.device.type == "cuda",
                            generator=generator)
        for images, labels in loader:
            images = images.to(self.device, non_blocking=True)
            yield self.finish(images), labels.to(self.device, non_blocking=True)
