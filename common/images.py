"""Data sets of image files: the TinyImageNet-200 tree as distributed, decoded once into memory,
and an ImageNet-layout folder (train/<class>/*, val/<class>/*) read from disk as it trains."""
import os
from contextlib import contextmanager

import numpy as np
import torch

from .run import UserError

RESTORE = "restore it from the original tiny-imagenet-200.zip"


def tiny_folder(data_dir):
    return os.path.join(data_dir, "tiny-imagenet-200")


def tinyimagenet_files(data_dir):
    """(train, val, classes): lists of (path, label) read from the tree as distributed.  The
    validation labels come from val/val_annotations.txt, read in memory: no file is moved or
    written, so any number of processes can do this at once.  Class indices follow the sorted
    wnids, as torchvision's ImageFolder would number train/<wnid> folders."""
    root = tiny_folder(data_dir)
    wnids_path = os.path.join(root, "wnids.txt")
    if not os.path.isfile(wnids_path):
        raise UserError(f"TinyImageNet not found: expected {root}/ with wnids.txt, train/ and "
                        "val/; pass --download to fetch it, or --data-dir to point at it")
    with text(wnids_path) as f:
        classes = sorted({line.strip() for line in f if line.strip()})
    if not classes:
        raise UserError(f"{wnids_path}: lists no class (one wnid a line); {RESTORE}")
    index = {wnid: i for i, wnid in enumerate(classes)}
    train = []
    for wnid in classes:
        folder = os.path.join(root, "train", wnid, "images")
        if not os.path.isdir(folder):
            raise UserError(f"{folder}: missing training folder of class {wnid} listed in "
                            "wnids.txt")
        images = [(os.path.join(folder, n), index[wnid]) for n in sorted(os.listdir(folder))
                  if n.lower().endswith((".jpeg", ".jpg", ".png"))]
        if not images:  # a class never trained on, or no training set at all
            raise UserError(f"{folder}: holds no image (*.JPEG) of class {wnid} listed in "
                            f"wnids.txt; {RESTORE}")
        train += images
    annotations = os.path.join(root, "val", "val_annotations.txt")
    if not os.path.isfile(annotations):
        raise UserError(f"{annotations} missing: the validation labels come from it; {RESTORE}")
    val = []
    with text(annotations) as f:
        for lineno, line in enumerate(f, 1):
            fields = line.rstrip("\n").split("\t")
            if not line.strip():
                continue
            if len(fields) < 2 or fields[1] not in index:
                raise UserError(f"{annotations}:{lineno}: label {fields[1:2] or '?'} is not in "
                                "wnids.txt")
            val.append((os.path.join(root, "val", "images", fields[0]), index[fields[1]]))
    if not val:  # else every epoch would test on no image at all
        raise UserError(f"{annotations}: lists no validation image; {RESTORE}")
    return train, val, classes


@contextmanager
def text(path):
    """`path` open as UTF-8 text; a byte that is not (a damaged copy) as one line naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            yield f
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not a text file (byte 0x{exc.object[exc.start]:02x} is not "
                        f"UTF-8); {RESTORE}") from None


def open_rgb(path):
    """The image file at `path`, decoded, as RGB; a file that is not one as one line naming it
    (raised in a DataLoader worker, `run.execute` still prints just that line)."""
    from PIL import Image
    # Not only OSError (truncated, not an image): a damaged or crafted header raises PIL's
    # DecompressionBombError, ValueError (a PNG text chunk too large, a bad PPM header)...
    try:
        with Image.open(path) as img:
            return img.convert("RGB")  # a decoded copy, whatever the mode (some are grayscale)
    except Exception as exc:
        raise UserError(f"{path}: cannot decode image ({type(exc).__name__}: {exc}); replace "
                        "it with an intact copy") from None


class DecodedImages(torch.utils.data.Dataset):
    def __init__(self, paths, size):
        self.paths, self.size = paths, size

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        from PIL import Image
        img = open_rgb(self.paths[i])
        if img.size != (self.size, self.size):
            img = img.resize((self.size, self.size), Image.BILINEAR)
        return torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1)


def decode_images(paths, out, workers):
    """Decode image files into `out` (uint8, an image a row, each resized to its side),
    `workers` processes in parallel."""
    loader = torch.utils.data.DataLoader(DecodedImages(paths, out.shape[-1]), batch_size=512,
                                         num_workers=workers if len(paths) > 512 else 0)
    for i, batch in enumerate(loader):  # in order, 512 a batch
        out[i * 512:i * 512 + len(batch)] = batch


def read_imagefolder(data_dir, image_size, auto_augment="none"):
    """(train, val) torchvision ImageFolder datasets with the ImageNet transforms: a random
    resized crop and flip for training (then TrivialAugment with `auto_augment="ta_wide"`);
    resize to 256/224 of the crop, center crop for val."""
    from torchvision import datasets, transforms
    for split in ("train", "val"):
        if not os.path.isdir(os.path.join(data_dir, split)):
            raise UserError(f"image folder not found: expected {os.path.join(data_dir, split)}/"
                            "<class>/*.JPEG (the ImageNet layout); point --data-dir at it")
    train = transforms.Compose([transforms.RandomResizedCrop(image_size),
                                transforms.RandomHorizontalFlip()] +
                               [transforms.TrivialAugmentWide()] * (auto_augment == "ta_wide") +
                               [transforms.PILToTensor()])
    val = transforms.Compose([transforms.Resize(int(round(image_size * 256 / 224))),
                              transforms.CenterCrop(image_size), transforms.PILToTensor()])
    try:  # a split without class folders, or a class folder without images
        train_set = datasets.ImageFolder(os.path.join(data_dir, "train"), transform=train,
                                         loader=open_rgb)
        val_set = datasets.ImageFolder(os.path.join(data_dir, "val"), transform=val,
                                       loader=open_rgb)
    except FileNotFoundError as exc:
        raise UserError(f"{data_dir}: {str(exc).rstrip('.')}; every class needs images in "
                        "train/ and val/") from None
    if val_set.classes != train_set.classes:
        raise UserError(f"{data_dir}: val/ and train/ hold different class folders")
    return train_set, val_set
