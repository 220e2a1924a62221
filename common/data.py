"""Data sets held in memory as uint8 tensors, and a loader that augments them on the device.

CIFAR-100 (150 MB) and TinyImageNet (1.2 GB) fit in memory as uint8.  They are read once,
moved to the training device, and every batch is cropped, flipped and normalised there as a
whole tensor: no per-sample PIL work in the training loop (that is what makes the public
solutions' GPUs wait).  The TinyImageNet JPEGs are decoded once, in parallel workers.
"""
import math
import os
import pickle
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

from .errors import UserError

CIFAR100_MEAN, CIFAR100_STD = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)
TINY_MEAN, TINY_STD = (0.4802, 0.4481, 0.3975), (0.2770, 0.2691, 0.2821)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)

TINY_URL = "http://cs231n.stanford.edu/tiny-imagenet-200.zip"
TINY_MD5 = "90528d7ca1a48142e341f4ef8d21d0de"


@dataclass
class ImageSet:
    """uint8 images (N x 3 x H x W) with int64 labels."""
    images: torch.Tensor
    labels: torch.Tensor
    classes: list

    def __len__(self):
        return len(self.labels)

    def limit(self, n, seed):
        """`n` samples spread evenly over the classes (`balanced_indices`); all when n is None."""
        keep = balanced_indices(self.labels, n, seed)
        if keep is None:
            return self
        return ImageSet(self.images[keep], self.labels[keep], self.classes)


def balanced_indices(labels, n, seed):
    """Indices of `n` of the samples with these labels, the classes as evenly represented as
    they allow: a seeded round robin over the classes, each class's samples in a seeded order.
    The order of the classes depends on `seed` only, so the training and test subsets of a run
    cover the same classes (all of them when n >= the number of classes).  Sorted; None when n
    is None or covers every sample."""
    labels = torch.as_tensor(labels, dtype=torch.int64)
    if n is None or n >= len(labels):
        return None
    g = torch.Generator().manual_seed(seed)
    num_classes = int(labels.max()) + 1
    class_turn = torch.randperm(num_classes, generator=g)  # the classes' order in each round
    shuffled = torch.randperm(len(labels), generator=g)  # the order within each class
    by_class = shuffled[torch.sort(labels[shuffled], stable=True).indices]
    sorted_labels = labels[by_class]
    first = torch.searchsorted(sorted_labels, sorted_labels, right=False)
    round_ = torch.arange(len(labels)) - first  # how many of its class come before it
    chosen = by_class[torch.argsort(round_ * num_classes + class_turn[sorted_labels])[:n]]
    return torch.sort(chosen).values


@dataclass(frozen=True)
class DatasetSpec:
    num_classes: int
    image_size: int
    train_size: int
    test_size: int
    mean: tuple
    std: tuple


SPECS = {
    "cifar100": DatasetSpec(100, 32, 50_000, 10_000, CIFAR100_MEAN, CIFAR100_STD),
    "tinyimagenet": DatasetSpec(200, 64, 100_000, 10_000, TINY_MEAN, TINY_STD),
}


DATASETS = ("cifar100", "tinyimagenet", "imagefolder")


def load_datasets(name, args):
    """(train, test) sets of data set `name` as the command line asks.

    CIFAR-100 and TinyImageNet come as in-memory ImageSets; an `imagefolder` as torchvision
    ImageFolder datasets read from disk by `imagefolder.FolderLoader`.
    """
    if name == "imagefolder":
        if args.dummy:  # ImageNet-shaped random data, held in memory: keep it modest
            spec = DatasetSpec(1000, args.image_size or 224, 10_000, 1_000, IMAGENET_MEAN, IMAGENET_STD)
            return (dummy_set(args.train_limit or spec.train_size, spec, seed=args.seed,
                              class_seed=args.seed),
                    dummy_set(args.test_limit or spec.test_size, spec, seed=args.seed + 1,
                              class_seed=args.seed))
        if args.download:
            raise UserError("--download: ImageNet cannot be downloaded automatically; get it "
                            "from image-net.org and point --data-dir at train/ and val/")
        from .imagefolder import limit_imagefolder, read_imagefolder
        train, test = read_imagefolder(args.data_dir, args.image_size or 224)
        return (limit_imagefolder(train, args.train_limit, args.seed),
                limit_imagefolder(test, args.test_limit, args.seed))
    spec = SPECS[name]
    if args.dummy:
        train = dummy_set(args.train_limit or spec.train_size, spec, seed=args.seed,
                          class_seed=args.seed)
        test = dummy_set(args.test_limit or spec.test_size, spec, seed=args.seed + 1,
                         class_seed=args.seed)
        return train, test
    if name == "cifar100":
        if args.download:
            download_cifar100(args.data_dir)
        train, test = read_cifar100(args.data_dir, True), read_cifar100(args.data_dir, False)
    else:
        if args.download:
            download_tinyimagenet(args.data_dir)
        train, test = read_tinyimagenet(args.data_dir, args.workers, args.train_limit,
                                        args.test_limit, seed=args.seed)
    return train.limit(args.train_limit, args.seed), test.limit(args.test_limit, args.seed)


def dummy_set(n, spec, seed, class_seed=0):
    """Random images of the real shapes (like pytorch/examples' --dummy), their labels as
    balanced over the classes as `balanced_indices` makes a limited real set: a round robin over
    the classes in an order drawn from `class_seed`, shared by a run's training and test sets."""
    g = torch.Generator().manual_seed(seed)
    size = spec.image_size
    images = torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=g)
    class_turn = torch.randperm(spec.num_classes,
                                generator=torch.Generator().manual_seed(class_seed))
    labels = class_turn[torch.arange(n) % spec.num_classes]
    labels = labels[torch.randperm(n, generator=g)]
    return ImageSet(images, labels, [str(i) for i in range(spec.num_classes)])


# ---------------------------------------------------------------- CIFAR-100 (python pickles)

def cifar100_folder(data_dir):
    return os.path.join(data_dir, "cifar-100-python")


def download_cifar100(data_dir):
    """Fetch and checksum the official archive through torchvision's downloader."""
    import torchvision
    url = torchvision.datasets.CIFAR100.url
    with _download_errors("CIFAR-100", url, data_dir,
                          cifar100_folder(data_dir) + "/{train,test,meta}"):
        torchvision.datasets.CIFAR100(data_dir, train=True, download=True)


@contextmanager
def _download_errors(name, url, data_dir, expected):
    """A failed download (no network, a proxy, a bad checksum) as one line that says how to put
    the data set in place by hand, instead of urllib's traceback."""
    try:
        yield
    except (OSError, RuntimeError) as exc:  # URLError and timeouts are OSErrors
        reason = (getattr(exc, "reason", None) or getattr(exc, "strerror", None) or str(exc)
                  or type(exc).__name__)
        raise UserError(f"--download: could not fetch {name} from {url} ({reason}); on a machine "
                        f"with network download {url.rsplit('/', 1)[-1]} and unpack it into "
                        f"{data_dir}, so that {expected} exist (README: Offline preparation), "
                        "then run without --download") from None


def read_cifar100(data_dir, train):
    folder = cifar100_folder(data_dir)
    path = os.path.join(folder, "train" if train else "test")
    if not os.path.isdir(folder):
        raise UserError(f"CIFAR-100 not found: expected {folder}/{{train,test,meta}}; "
                        "pass --download to fetch it, or --data-dir to point at it")
    batch = _unpickle(path)
    meta = _unpickle(os.path.join(folder, "meta"))
    classes = [n.decode() if isinstance(n, bytes) else n for n in meta.get(b"fine_label_names", [])]
    data, labels = batch.get(b"data"), batch.get(b"fine_labels")
    if not isinstance(data, np.ndarray) or labels is None:
        raise UserError(f"{path}: not a CIFAR-100 pickle (needs b'data' and b'fine_labels'); "
                        "re-download with --download")
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32 \
            or len(labels) != len(data):
        raise UserError(f"{path}: malformed CIFAR-100 pickle (data {data.dtype} {data.shape}, "
                        f"{len(labels)} labels); re-download with --download")
    labels = torch.as_tensor(labels, dtype=torch.int64)
    if len(classes) != 100 or len(labels) == 0 or labels.min() < 0 or labels.max() >= 100:
        raise UserError(f"{path}: labels or class names are not those of CIFAR-100's 100 classes; "
                        "re-download with --download")
    images = torch.from_numpy(data.reshape(-1, 3, 32, 32).copy())
    return ImageSet(images, labels, classes)


class _CifarUnpickler(pickle.Unpickler):
    """An unpickler that builds only what the official CIFAR-100 files hold: dicts, lists,
    bytes, strings and numbers (made by opcodes, never looked up here) and numpy arrays.
    Any other class or function, the way a crafted pickle runs code, is refused."""

    _reconstruct = np.zeros(0).__reduce__()[0]  # numpy's own, under whichever module name
    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"): _reconstruct,  # as the files name it
        ("numpy._core.multiarray", "_reconstruct"): _reconstruct,  # numpy 2's name
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
    }

    def __init__(self, file, path):
        super().__init__(file, encoding="bytes")
        self.path = path

    def find_class(self, module, name):
        try:
            return self.ALLOWED[(module, name)]
        except KeyError:
            what = f"{module}.{name}"[:100]  # repr: a crafted name may hold line breaks
            raise UserError(f"{self.path}: refused: the pickle asks for {what!r}, which "
                            "CIFAR-100 files never hold (it could run code); re-download "
                            "with --download") from None


def _unpickle(path):
    if not os.path.isfile(path):
        raise UserError(f"CIFAR-100 file missing: {path}; pass --download to fetch the data set")
    try:
        with open(path, "rb") as f:
            obj = _CifarUnpickler(f, path).load()
    except UserError:
        raise
    except Exception as exc:  # truncated, empty or not a pickle at all
        raise UserError(f"{path}: unreadable CIFAR-100 pickle ({exc.__class__.__name__}: {exc}); "
                        "re-download with --download") from None
    if not isinstance(obj, dict):
        raise UserError(f"{path}: not a CIFAR-100 pickle (holds a {type(obj).__name__}, not a dict)")
    return obj


# ------------------------------------------------------- TinyImageNet-200 (the folder tree)

def tiny_folder(data_dir):
    return os.path.join(data_dir, "tiny-imagenet-200")


def download_tinyimagenet(data_dir):
    from torchvision.datasets.utils import download_and_extract_archive
    if not os.path.isdir(tiny_folder(data_dir)):
        with _download_errors("TinyImageNet", TINY_URL, data_dir,
                              tiny_folder(data_dir) + "/{wnids.txt,train,val}"):
            download_and_extract_archive(TINY_URL, data_dir, md5=TINY_MD5)


def tinyimagenet_files(data_dir):
    """(train, val, classes): lists of (path, label) read from the tree as distributed.

    The validation labels come from val/val_annotations.txt, read in memory: no file is
    moved or written, so any number of processes can do this at once.  Class indices follow
    the sorted wnids, as torchvision's ImageFolder would number train/<wnid> folders.
    """
    root = tiny_folder(data_dir)
    wnids_path = os.path.join(root, "wnids.txt")
    if not os.path.isfile(wnids_path):
        raise UserError(f"TinyImageNet not found: expected {root}/ with wnids.txt, train/ and val/; "
                        "pass --download to fetch it, or --data-dir to point at it")
    with open(wnids_path) as f:
        classes = sorted({line.strip() for line in f if line.strip()})
    index = {wnid: i for i, wnid in enumerate(classes)}

    train = []
    for wnid in classes:
        folder = os.path.join(root, "train", wnid, "images")
        if not os.path.isdir(folder):
            raise UserError(f"{folder}: missing training folder of class {wnid} listed in wnids.txt")
        train += [(os.path.join(folder, n), index[wnid]) for n in sorted(os.listdir(folder))
                  if n.lower().endswith((".jpeg", ".jpg", ".png"))]

    annotations = os.path.join(root, "val", "val_annotations.txt")
    if not os.path.isfile(annotations):
        raise UserError(f"{annotations} missing: the validation labels come from it; "
                        "restore it from the original tiny-imagenet-200.zip")
    val = []
    with open(annotations) as f:
        for lineno, line in enumerate(f, 1):
            fields = line.rstrip("\n").split("\t")
            if not line.strip():
                continue
            if len(fields) < 2 or fields[1] not in index:
                raise UserError(f"{annotations}:{lineno}: label {fields[1:2] or '?'} is not in wnids.txt")
            val.append((os.path.join(root, "val", "images", fields[0]), index[fields[1]]))
    return train, val, classes


def read_tinyimagenet(data_dir, workers=4, train_limit=None, test_limit=None, seed=0):
    """The training and validation sets, decoded; a limit picks the files (`balanced_indices`)
    before any is decoded."""
    train, val, classes = tinyimagenet_files(data_dir)
    train, val = _pick(train, train_limit, seed), _pick(val, test_limit, seed)
    return (ImageSet(decode_images([p for p, _ in train], 64, workers),
                     torch.tensor([y for _, y in train], dtype=torch.int64), classes),
            ImageSet(decode_images([p for p, _ in val], 64, workers),
                     torch.tensor([y for _, y in val], dtype=torch.int64), classes))


def _pick(files, n, seed):
    """`n` of the (path, label) pairs, balanced over the labels."""
    keep = balanced_indices([label for _, label in files], n, seed) if files else None
    return files if keep is None else [files[i] for i in keep.tolist()]


class _DecodedImages(torch.utils.data.Dataset):
    def __init__(self, paths, size):
        self.paths, self.size = paths, size

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        from PIL import Image
        try:
            with Image.open(self.paths[i]) as img:
                img = img.convert("RGB")  # some TinyImageNet images are grayscale
                if img.size != (self.size, self.size):
                    img = img.resize((self.size, self.size), Image.BILINEAR)
                array = np.asarray(img, dtype=np.uint8)
        except OSError as exc:
            raise UserError(f"{self.paths[i]}: cannot decode image ({exc})") from None
        return torch.from_numpy(array.copy()).permute(2, 0, 1)


def decode_images(paths, size, workers):
    """Decode image files into one uint8 tensor, `workers` processes in parallel."""
    out = torch.empty((len(paths), 3, size, size), dtype=torch.uint8)
    loader = torch.utils.data.DataLoader(_DecodedImages(paths, size), batch_size=512,
                                         num_workers=workers if len(paths) > 512 else 0)
    start = 0
    for batch in loader:
        out[start:start + len(batch)] = batch
        start += len(batch)
    return out


# ------------------------------------------------------------------ loading onto the device

class ShardedLoader:
    """This rank's share of a data set, in batches, finished on the training device.

    Training: a DistributedSampler gives this rank its shard of a permutation that changes
    every epoch (`set_epoch`).  Test: this rank's samples are ``rank::world_size``, unpadded,
    so that summing over ranks counts each test sample exactly once.  `finish` normalises a
    uint8 batch on the device (and optionally resizes it and makes it channels_last).
    """

    def __init__(self, size, batch_size, device, *, train, mean, std, rank=0, world_size=1,
                 seed=0, image_size=None, channels_last=False):
        self.size, self.batch_size, self.device = size, batch_size, torch.device(device)
        self.train, self.rank, self.world_size, self.seed, self.epoch = train, rank, world_size, seed, 0
        self.image_size, self.channels_last = image_size, channels_last
        std = torch.tensor(std, device=device).view(1, 3, 1, 1)
        self.scale = 1.0 / (255.0 * std)
        self.shift = -torch.tensor(mean, device=device).view(1, 3, 1, 1) / std
        self.sampler = None
        if train:
            self.sampler = DistributedSampler(range(size), num_replicas=world_size, rank=rank,
                                              shuffle=True, seed=seed)

    def set_epoch(self, epoch):
        self.epoch = epoch
        if self.sampler is not None:
            self.sampler.set_epoch(epoch)

    def indices(self):
        if self.sampler is not None:
            return list(self.sampler)
        return list(range(self.rank, self.size, self.world_size))

    def __len__(self):
        samples = self.sampler.num_samples if self.sampler is not None else \
            len(range(self.rank, self.size, self.world_size))
        return math.ceil(samples / self.batch_size)

    def __iter__(self):
        return self.batches()

    def batches(self, start=0):
        raise NotImplementedError

    def finish(self, x):
        x = x.float() * self.scale + self.shift
        if self.image_size and self.image_size != x.shape[-1]:
            x = F.interpolate(x, size=(self.image_size, self.image_size), mode="bilinear",
                              align_corners=False)
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x


class DeviceLoader(ShardedLoader):
    """Batches of an in-memory ImageSet, held and augmented on the training device.

    Each training batch gets a random crop with zero padding (`pad`, default 1/8 of the side)
    and a horizontal flip, drawn per batch; test batches are only normalised.
    """

    def __init__(self, data, batch_size, device, *, train, pad=None, augment=None, **shard):
        super().__init__(len(data), batch_size, device, train=train, **shard)
        self.images = data.images.to(device)
        self.labels = data.labels.to(device)
        self.augment = train if augment is None else augment
        self.pad = data.images.shape[-1] // 8 if pad is None else pad

    def batches(self, start=0):
        """The epoch's batches from batch number `start` on (a resumed epoch skips the rest).

        Each batch's augmentation is drawn from a generator seeded by (seed, epoch, rank,
        batch number), so batch k is the same whether or not the epoch was interrupted.
        """
        order = torch.tensor(self.indices(), dtype=torch.int64, device=self.device)
        gen = torch.Generator(self.device) if self.augment else None
        for k in range(start, len(self)):
            idx = order[k * self.batch_size:(k + 1) * self.batch_size]
            x = self.images[idx]
            if self.augment:
                gen.manual_seed(hash((self.seed, self.epoch, self.rank, k)) % 2**63)
                x = random_crop_flip(x, self.pad, gen)
            yield self.finish(x), self.labels[idx]


def random_crop_flip(x, pad, gen):
    """Per-sample random crop (zero padding `pad`) and horizontal flip of a uint8 batch.

    Equivalent to torchvision's RandomCrop(size, padding=pad) + RandomHorizontalFlip(),
    done as two gathers over the whole batch.
    """
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


def normalization(name, pretrained=False):
    """(mean, std): the data set's own, or ImageNet's for ImageNet weights and image folders."""
    if pretrained or name not in SPECS:
        return IMAGENET_MEAN, IMAGENET_STD
    return SPECS[name].mean, SPECS[name].std


def _loader(data, batch_size, args, run, train, pretrained, rank, world_size):
    mean, std = normalization(args.dataset, pretrained)
    if isinstance(data, ImageSet):
        return DeviceLoader(data, batch_size, run.device, train=train, mean=mean, std=std,
                            rank=rank, world_size=world_size, seed=args.seed,
                            image_size=args.image_size, channels_last=run.amp)
    from .imagefolder import FolderLoader
    return FolderLoader(data, batch_size, run.device, train=train, mean=mean, std=std,
                        rank=rank, world_size=world_size, seed=args.seed, workers=args.workers,
                        channels_last=run.amp)


def train_loader(train_set, args, run, *, pretrained=False, batch_size=None, rank=0,
                 world_size=1):
    """This rank's shard of the training set; `batch_size` is per rank (default --batch-size).
    Normalised with `normalization(args.dataset, pretrained)`, resized to --image-size."""
    return _loader(train_set, batch_size or args.batch_size, args, run, True, pretrained, rank,
                   world_size)


def test_loader(test_set, args, run, *, pretrained=False, rank=0, world_size=1):
    return _loader(test_set, max(args.batch_size, 256), args, run, False, pretrained, rank,
                   world_size)


def make_loaders(train_set, test_set, args, run, *, pretrained=False, batch_size=None,
                 rank=0, world_size=1):
    """Training and test loaders of this rank."""
    shard = dict(pretrained=pretrained, rank=rank, world_size=world_size)
    return (train_loader(train_set, args, run, batch_size=batch_size, **shard),
            test_loader(test_set, args, run, **shard))


def describe(data):
    """"50,000 images 3x32x32" -- for the log."""
    if isinstance(data, ImageSet):
        return f"{len(data):,} images {'x'.join(map(str, data.images.shape[1:]))}"
    return f"{len(data):,} image files"
