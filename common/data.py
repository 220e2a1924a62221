"""The data sets as they lie on disk -- CIFAR-100's python pickles, the TinyImageNet-200 tree, an
ImageNet-layout folder -- their download, --train-limit/--test-limit and --dummy stand-ins.

CIFAR-100 (184 MB) and TinyImageNet (1.35 GB) are read into memory as uint8 tensors (the JPEGs
decoded once per run, by parallel workers, the ranks of sync or async SGD sharing the work); an
image folder stays on disk as torchvision ImageFolder datasets.  Each way a file can be missing,
damaged or crafted is one line naming it.
"""
import os
from collections import namedtuple
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .cifar import cifar100_folder, read_cifar100_pickles
from .folders import make_folders, remove_empty
from .images import decode_images, read_imagefolder, tiny_folder, tinyimagenet_files
from .peers import peer_lost_as
from .run import UserError

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
TINY_URL = "http://cs231n.stanford.edu/tiny-imagenet-200.zip"
TINY_MD5 = "90528d7ca1a48142e341f4ef8d21d0de"


DatasetSpec = namedtuple("DatasetSpec", "num_classes image_size train_size test_size mean std")
SPECS = {"cifar100": DatasetSpec(100, 32, 50_000, 10_000, (0.5071, 0.4865, 0.4409),
                                 (0.2673, 0.2564, 0.2762)),
         "tinyimagenet": DatasetSpec(200, 64, 100_000, 10_000, (0.4802, 0.4481, 0.3975),
                                     (0.2770, 0.2691, 0.2821)),
         # --dummy only: ImageNet-shaped random data held in memory, so kept modest
         "imagefolder": DatasetSpec(1000, 224, 10_000, 1_000, IMAGENET_MEAN, IMAGENET_STD)}
DATASETS = tuple(SPECS)


@dataclass
class ImageSet:
    """uint8 images (N x 3 x H x W) with int64 labels."""
    images: torch.Tensor
    labels: torch.Tensor
    classes: list

    def __len__(self):
        return len(self.labels)


def balanced_indices(labels, n, seed):
    """Indices of `n` of the samples with these labels, the classes as evenly represented as
    they allow: a seeded round robin over the classes, each class's samples in a seeded order.
    The classes' order depends on `seed` only, so the training and test subsets of a run cover
    the same classes.  Sorted; None when n is None or covers every sample."""
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


def pick(items, labels, n, seed):
    """`n` of `items` (a list, or an ImageSet), balanced over `labels` (`balanced_indices`)."""
    keep = balanced_indices(labels, n, seed) if len(labels) else None
    if keep is None:
        return items
    if isinstance(items, ImageSet):
        return ImageSet(items.images[keep], items.labels[keep], items.classes)
    return [items[i] for i in keep.tolist()]


def load_datasets(name, args, comm=None, parameter_server=False):
    """(train, test) sets of data set `name` as the command line asks: ImageSets in memory, or
    for an `imagefolder` torchvision ImageFolder datasets read from disk.  With `comm`, the
    ranks share TinyImageNet's decoding (`decoding_plan`)."""
    if args.dummy:
        spec = SPECS[name]
        size = (args.image_size or spec.image_size) if name == "imagefolder" else spec.image_size
        return (dummy_set(args.train_limit or spec.train_size, spec, size, args.seed, args.seed),
                dummy_set(args.test_limit or spec.test_size, spec, size, args.seed + 1, args.seed))
    if name == "imagefolder":
        if args.download:
            raise UserError("--download: ImageNet cannot be downloaded automatically; get it "
                            "from image-net.org and point --data-dir at train/ and val/")
        train, test = read_imagefolder(args.data_dir, args.image_size or 224, args.auto_augment)
        for dataset, n in ((train, args.train_limit), (test, args.test_limit)):
            dataset.samples = dataset.imgs = pick(dataset.samples, dataset.targets, n, args.seed)
            dataset.targets = [label for _, label in dataset.samples]
        return train, test
    if name == "cifar100":
        if args.download:
            download(args.data_dir, "CIFAR-100", cifar100_folder(args.data_dir) +
                     "/{train,test,meta}", cifar100=True)
        train, test = read_cifar100(args.data_dir, True), read_cifar100(args.data_dir, False)
        return (pick(train, train.labels, args.train_limit, args.seed),
                pick(test, test.labels, args.test_limit, args.seed))
    if args.download and not os.path.isdir(tiny_folder(args.data_dir)):
        download(args.data_dir, "TinyImageNet", tiny_folder(args.data_dir) +
                 "/{wnids.txt,train,val}")
    return read_tinyimagenet(args.data_dir, args.workers, args.train_limit, args.test_limit,
                             args.seed, decoding_plan(comm, parameter_server, args.evaluate))


def read_cifar100(data_dir, train):
    return ImageSet(*read_cifar100_pickles(data_dir, train))


ALONE, SKIP = None, "skip"  # decode every file of a set yourself; decode none (never read)


def decoding_plan(comm, parameter_server=False, evaluate=False):
    """Who decodes the (training, test) images: in sync SGD every rank a share of both sets; in
    async SGD the workers a share of the training set each, and the server, which never
    trains, the test set alone (it alone evaluates).  With --evaluate no one decodes the
    training set: only its labels serve (its classes, an epoch's length for the schedule).  A
    process group means "a share each": one that takes the CPU tensors the images are decoded
    into (`Comm.cpu_group`)."""
    if comm is None or comm.world_size == 1:
        return SKIP if evaluate else ALONE, ALONE
    if not parameter_server:
        everyone = comm.cpu_group()
        return SKIP if evaluate else everyone, everyone
    workers = SKIP if evaluate else comm.cpu_group(range(1, comm.world_size))  # all or none
    return (SKIP, ALONE) if comm.rank == 0 else (workers, SKIP)


def read_tinyimagenet(data_dir, workers=4, train_limit=None, test_limit=None, seed=0,
                      plan=(ALONE, ALONE)):
    """The training and validation sets, decoded as `plan` says (`decoding_plan`); a limit
    picks the files before any is.  A set not decoded has its labels but no pixels."""
    train, val, classes = tinyimagenet_files(data_dir)
    sets = []
    for files, n, who in ((train, train_limit, plan[0]), (val, test_limit, plan[1])):
        paths, labels = zip(*pick(files, [label for _, label in files], n, seed))
        images = (torch.empty((0, 3, 64, 64), dtype=torch.uint8) if who == SKIP else
                  decode_shared(paths, 64, workers, who))
        sets.append(ImageSet(images, torch.tensor(labels), classes))
    return tuple(sets)


def decode_shared(paths, size, workers, group):
    """The image files decoded into one uint8 tensor.  With a process `group`, each of its n
    ranks decodes 1/n of the files into its slice and broadcasts it to the others: the work of
    one decoding, not n (TinyImageNet on 2 ranks of 2 cores: ready in 18 s, not 36), and no
    copy besides the set itself."""
    out = torch.empty((len(paths), 3, size, size), dtype=torch.uint8)
    n, rank = (1, 0) if group is ALONE else (dist.get_world_size(group), dist.get_rank(group))
    bounds = [len(paths) * r // n for r in range(n + 1)]
    decode_images(paths[bounds[rank]:bounds[rank + 1]], out[bounds[rank]:bounds[rank + 1]],
                  workers)
    with peer_lost_as(lambda why: f"rank {dist.get_rank()} lost contact with another rank while "
                                  f"they decoded the images ({why}); that rank's own output says "
                                  "why; the same command tries again"):
        for r in range(n if group is not ALONE else 0):
            dist.broadcast(out[bounds[r]:bounds[r + 1]], src=dist.get_global_rank(group, r),
                           group=group)
    return out


def dummy_set(n, spec, size, seed, class_seed):
    """Random images (like pytorch/examples' --dummy), their labels as balanced over the classes
    as a limited real set's: a round robin over the classes in an order drawn from
    `class_seed`, shared by a run's training and test sets."""
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=g)
    class_turn = torch.randperm(spec.num_classes,
                                generator=torch.Generator().manual_seed(class_seed))
    labels = class_turn[torch.arange(n) % spec.num_classes][torch.randperm(n, generator=g)]
    return ImageSet(images, labels, [str(i) for i in range(spec.num_classes)])


def download(data_dir, name, expected, cifar100=False):
    """Fetch and checksum the official archive with torchvision's downloader; a failure (no
    network, a proxy, a bad checksum) as one line that says how to put it in place by hand."""
    import torchvision
    from torchvision.datasets.utils import download_and_extract_archive
    url = torchvision.datasets.CIFAR100.url if cifar100 else TINY_URL
    try:
        made = make_folders(data_dir)
    except OSError as exc:  # not a network problem: say so, and what to change
        why = "a file is there" if os.path.isfile(data_dir) else exc.strerror
        raise UserError(f"--data-dir {data_dir}: cannot make the folder to download into "
                        f"({why}); choose a folder you can write") from None
    try:
        if cifar100:
            torchvision.datasets.CIFAR100(data_dir, train=True, download=True)
        else:
            download_and_extract_archive(TINY_URL, data_dir, md5=TINY_MD5)
    except (OSError, RuntimeError) as exc:  # URLError and timeouts are OSErrors
        remove_empty(made)  # leave no empty folder behind
        reason = (getattr(exc, "reason", None) or getattr(exc, "strerror", None) or str(exc)
                  or type(exc).__name__)
        raise UserError(f"--download: could not fetch {name} from {url} ({reason}); on a machine "
                        f"with network download {url.rsplit('/', 1)[-1]} and unpack it into "
                        f"{data_dir}, so that {expected} exist (README: Offline preparation), "
                        "then run without --download") from None


def describe(data):
    """"50,000 images 3x32x32" -- for the log."""
    if isinstance(data, ImageSet):  # (a set decoded by other ranks has no pixels here)
        return f"{len(data):,} images {'x'.join(map(str, data.images.shape[1:]))}"
    return f"{len(data):,} image files"
