"""The data sets as they lie on disk: CIFAR-100's python pickles, the TinyImageNet-200 tree and
an ImageNet-layout folder; their download, limits and --dummy stand-ins.  (common/loader.py
turns them into batches on the device.)

Over 250 lines because each format is read and checked in one place, with one clear line for
each way a file can be missing, damaged or crafted.  CIFAR-100 (184 MB) and TinyImageNet
(1.35 GB) are read into memory as uint8 tensors, the TinyImageNet JPEGs decoded once by parallel
workers; an image folder (ImageNet) stays on disk as torchvision ImageFolder datasets whose
transforms crop and flip each sample: random-resized crop + flip for training, resize to
256/224 of the crop and center crop for validation.
"""
import os
import pickle
import reprlib
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from .process import UserError, make_folders, remove_empty

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
    ImageFolder datasets read from disk by `loader.FolderLoader`.
    """
    if name == "imagefolder":
        if args.dummy:  # ImageNet-shaped random data, held in memory: keep it modest
            spec = DatasetSpec(1000, args.image_size or 224, 10_000, 1_000, IMAGENET_MEAN,
                               IMAGENET_STD)
            return (dummy_set(args.train_limit or spec.train_size, spec, seed=args.seed,
                              class_seed=args.seed),
                    dummy_set(args.test_limit or spec.test_size, spec, seed=args.seed + 1,
                              class_seed=args.seed))
        if args.download:
            raise UserError("--download: ImageNet cannot be downloaded automatically; get it "
                            "from image-net.org and point --data-dir at train/ and val/")
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
        made = make_folders(data_dir)
    except OSError as exc:  # not a network problem: say so, and what to change
        why = "a file is there" if os.path.isfile(data_dir) else exc.strerror
        raise UserError(f"--data-dir {data_dir}: cannot make the folder to download into "
                        f"({why}); choose a folder you can write") from None
    try:
        yield
    except (OSError, RuntimeError) as exc:  # URLError and timeouts are OSErrors
        remove_empty(made)  # leave no empty folder behind
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
    classes = _class_names(os.path.join(folder, "meta"))
    data, labels = batch.get(b"data"), batch.get(b"fine_labels")
    if data is None or labels is None:
        raise UserError(f"{path}: not a CIFAR-100 pickle (needs b'data' and b'fine_labels'); "
                        "re-download with --download")
    labels = _fine_labels(path, labels)
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 \
            or data.shape != (len(labels), 3 * 32 * 32):
        found = (f"dtype {data.dtype}, shape {data.shape}" if isinstance(data, np.ndarray)
                 else _what(data))
        raise _field_error(path, "data", f"a uint8 array of {len(labels)} x {3 * 32 * 32} (an "
                           "image per label)", found)
    images = torch.from_numpy(data.reshape(-1, 3, 32, 32).copy())
    return ImageSet(images, labels, classes)


def _class_names(path):
    """meta's b'fine_label_names': 100 names, Python 2 strings (bytes here), decoded as latin-1
    as torchvision does (the official names are ASCII)."""
    names = _unpickle(path).get(b"fine_label_names")
    if not isinstance(names, list) or len(names) != 100:
        raise _field_error(path, "fine_label_names", "a list of 100 class names", _what(names))
    for i, name in enumerate(names):
        if not isinstance(name, (bytes, str)):
            raise _field_error(path, "fine_label_names", "a list of 100 class names",
                               f"{_what(name)} at index {i}")
    return [n.decode("latin-1") if isinstance(n, bytes) else n for n in names]


def _fine_labels(path, labels):
    """b'fine_labels' as int64: a list of Python ints 0..99, checked before torch sees them (it
    would truncate a float, overflow on a huge int, refuse a string with a traceback)."""
    if not isinstance(labels, list) or not labels:
        raise _field_error(path, "fine_labels", "a list of labels 0 to 99", _what(labels))
    for i, y in enumerate(labels):
        if type(y) is not int or not 0 <= y < 100:  # bool is an int, but never a label
            raise _field_error(path, "fine_labels", "a list of labels 0 to 99",
                               f"{_what(y)} at index {i}")
    return torch.tensor(labels, dtype=torch.int64)


def _what(value):
    """"5 (int)": a field's value for an error line, cut short (reprlib: a crafted one may be
    huge or nested past the recursion limit)."""
    return f"{reprlib.repr(value)} ({type(value).__name__})"


def _field_error(path, field, expected, found):
    return UserError(f"{path}: field b'{field}' must be {expected}; found {found}; "
                     "re-download with --download")


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
        raise UserError(f"{path}: not a CIFAR-100 pickle (holds a {type(obj).__name__}, not a "
                        "dict)")
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
        raise UserError(f"TinyImageNet not found: expected {root}/ with wnids.txt, train/ and "
                        "val/; pass --download to fetch it, or --data-dir to point at it")
    with _text(wnids_path) as f:
        classes = sorted({line.strip() for line in f if line.strip()})
    if not classes:
        raise UserError(f"{wnids_path}: lists no class (one wnid a line); restore it from "
                        "the original tiny-imagenet-200.zip")
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
                            "wnids.txt; restore it from the original tiny-imagenet-200.zip")
        train += images

    annotations = os.path.join(root, "val", "val_annotations.txt")
    if not os.path.isfile(annotations):
        raise UserError(f"{annotations} missing: the validation labels come from it; "
                        "restore it from the original tiny-imagenet-200.zip")
    val = []
    with _text(annotations) as f:
        for lineno, line in enumerate(f, 1):
            fields = line.rstrip("\n").split("\t")
            if not line.strip():
                continue
            if len(fields) < 2 or fields[1] not in index:
                raise UserError(f"{annotations}:{lineno}: label {fields[1:2] or '?'} is not in "
                                "wnids.txt")
            val.append((os.path.join(root, "val", "images", fields[0]), index[fields[1]]))
    if not val:  # else every epoch would test on no image at all
        raise UserError(f"{annotations}: lists no validation image; restore it from the "
                        "original tiny-imagenet-200.zip")
    return train, val, classes


@contextmanager
def _text(path):
    """`path` open as UTF-8 text; a byte that is not (a damaged copy) as one line naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            yield f
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not a text file (byte 0x{exc.object[exc.start]:02x} is not "
                        "UTF-8); restore it from the original tiny-imagenet-200.zip") from None


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
        img = _open_rgb(self.paths[i])  # some TinyImageNet images are grayscale
        if img.size != (self.size, self.size):
            img = img.resize((self.size, self.size), Image.BILINEAR)
        return torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1)


def _open_rgb(path):
    """The image file at `path`, decoded, as RGB; a file that is not one as one line naming it
    (raised in a DataLoader worker, `process.execute` still prints just that line)."""
    from PIL import Image
    # Not only OSError (truncated, not an image): a damaged or crafted header raises PIL's
    # DecompressionBombError, ValueError (a PNG text chunk too large, a bad PPM header)...
    try:
        with Image.open(path) as img:
            return img.convert("RGB")  # a decoded copy, whatever the mode
    except Exception as exc:
        raise UserError(f"{path}: cannot decode image ({type(exc).__name__}: {exc}); replace "
                        "it with an intact copy") from None


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


# ------------------------------------------------- an ImageNet-layout folder (train/, val/)

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
    try:  # a split without class folders, or a class folder without images
        train_set = datasets.ImageFolder(os.path.join(data_dir, "train"), transform=train,
                                         loader=_open_rgb)
        val_set = datasets.ImageFolder(os.path.join(data_dir, "val"), transform=val,
                                       loader=_open_rgb)
    except FileNotFoundError as exc:
        raise UserError(f"{data_dir}: {str(exc).rstrip('.')}; every class needs images in "
                        "train/ and val/") from None
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


def describe(data):
    """"50,000 images 3x32x32" -- for the log."""
    if isinstance(data, ImageSet):
        return f"{len(data):,} images {'x'.join(map(str, data.images.shape[1:]))}"
    return f"{len(data):,} image files"
