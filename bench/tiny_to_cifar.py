"""Real photos in CIFAR-100's shape: a tiny-imagenet-200 tree turned into the CIFAR-100 python
layout, so that resnet_cifar100.py (and bench/convergence.py --real) can run on real images.

    python bench/tiny_to_cifar.py --data-dir DIR --out OUT   # DIR/tiny-imagenet-200 -> OUT/cifar-100-python

The first 100 wnids in sorted order are the classes (fine label = rank in that order); each
gets its 500 training images and its 50 validation images as the test set; every 64x64 image
is shrunk to 32x32 by averaging each 2x2 block (area averaging).  `--per-class-train` and
`--per-class-test` keep fewer, the first in file order.  `--validation N` writes a validation
split instead, for choosing a recipe without reading the test set: the test pickle holds the last
N of each class's training images, the train pickle the others.  No coarse labels: TinyImageNet
has none.  The pickles are protocol 4 with bytes keys, which the scripts' reader loads like the
official Python 2 files.
"""
import argparse
import os
import pickle
import sys

import numpy as np
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.images import tinyimagenet_files  # noqa: E402


def area_average(path):
    """The image at `path` as RGB uint8 32x32 x 3: each output pixel the mean of a 2x2 block."""
    with Image.open(path) as img:
        x = np.asarray(img.convert("RGB"), dtype=np.float32)
    if x.shape[:2] != (64, 64):
        raise SystemExit(f"{path}: {x.shape[1]}x{x.shape[0]}, not the 64x64 of TinyImageNet")
    return np.rint(x.reshape(32, 2, 32, 2, 3).mean(axis=(1, 3))).astype(np.uint8)


def split(files, keep, start, stop):
    """(data N x 3072 in CIFAR's channel-planar order, fine labels, file names) of the images
    of the kept classes, the `start`-th to before the `stop`-th of each, in class order."""
    chosen, seen = [], {}
    for path, label in files:
        if label in keep:
            seen[label] = seen.get(label, 0) + 1
            if start < seen[label] <= stop:
                chosen.append((path, keep[label]))
    chosen.sort(key=lambda item: item[1])  # stable: each class's files in their order
    data = np.stack([area_average(p).transpose(2, 0, 1).reshape(-1) for p, _ in chosen])
    return data, [y for _, y in chosen], [os.path.basename(p).encode() for p, _ in chosen]


def write(path, obj):
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=4)


def convert(data_dir, out, num_classes=100, per_class_train=500, per_class_test=50,
            validation=0):
    """`validation` > 0: the test set is the last `validation` of each class's first
    `per_class_train` training images, the training set the others."""
    train, val, classes = tinyimagenet_files(data_dir)
    keep = {i: i for i in range(num_classes)}  # the first classes in sorted wnid order
    folder = os.path.join(out, "cifar-100-python")
    os.makedirs(folder, exist_ok=True)
    held = per_class_train - validation
    parts = ((("train", train, 0, held), ("test", train, held, per_class_train)) if validation
             else (("train", train, 0, per_class_train), ("test", val, 0, per_class_test)))
    for name, files, start, stop in parts:
        data, labels, names = split(files, keep, start, stop)
        write(os.path.join(folder, name), {b"batch_label": f"{name} from TinyImageNet".encode(),
                                           b"filenames": names, b"fine_labels": labels,
                                           b"data": data})
        print(f"{name}: {len(labels)} images, {num_classes} classes")
    write(os.path.join(folder, "meta"),
          {b"fine_label_names": [c.encode() for c in classes[:num_classes]]})
    return folder


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data-dir", required=True, help="folder holding tiny-imagenet-200/")
    p.add_argument("--out", required=True, help="folder to write cifar-100-python/ into")
    p.add_argument("--per-class-train", type=int, default=500)
    p.add_argument("--per-class-test", type=int, default=50)
    p.add_argument("--validation", type=int, default=0, metavar="N",
                   help="test pickle: the last N training images of each class, not the test set")
    a = p.parse_args()
    if not 0 <= a.validation < a.per_class_train:
        p.error(f"--validation must be from 0 to below --per-class-train ({a.per_class_train})")
    print(convert(a.data_dir, a.out, 100, a.per_class_train, a.per_class_test, a.validation))


if __name__ == "__main__":
    main()
