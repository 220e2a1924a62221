"""Data loading: CIFAR-100 pickles, the TinyImageNet tree, DeviceLoader, --dummy, limits."""
import importlib
import json
import os
import pickle
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import resnet_cifar100
from common import data, flags
from common.loader import DeviceLoader, FolderLoader
from common import run as run_module
from common.run import UserError
from tests.datagen import (CIFAR100_FINE_LABEL_NAMES, DAMAGED_IMAGES, cifar_label_from_image,
                           dump_cifar_pickle, make_cifar100, make_imagefolder,
                           make_tinyimagenet, snapshot_tree, tiny_label_from_image,
                           write_damaged_image)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parser():
    return flags.make_parser("test", "test", resnet_cifar100.RECIPE, dataset="cifar100",
                             arch="hw4")


def parse(*argv):
    return parser().parse_args(list(argv))


# ------------------------------------------------------------------------------ CIFAR-100

def test_cifar_loader_shapes_labels_classes(cifar_dir):
    train = data.read_cifar100(str(cifar_dir), True)
    test = data.read_cifar100(str(cifar_dir), False)
    assert train.images.shape == (200, 3, 32, 32) and test.images.shape == (100, 3, 32, 32)
    assert train.images.dtype == torch.uint8 and train.labels.dtype == torch.int64
    assert train.labels.shape == (200,) and test.labels.shape == (100,)
    for s in (train, test):
        assert [cifar_label_from_image(img) for img in s.images] == s.labels.tolist()
    assert train.classes == list(CIFAR100_FINE_LABEL_NAMES)
    assert all(isinstance(c, str) for c in train.classes)
    # the labels follow the pickle's order and cover the classes
    with open(cifar_dir / "cifar-100-python" / "train", "rb") as f:
        raw = pickle.load(f, encoding="bytes")
    assert train.labels.tolist() == raw[b"fine_labels"]
    assert np.array_equal(train.images.reshape(200, -1).numpy(), raw[b"data"])
    assert set(train.labels.tolist()) == set(range(100))


@pytest.fixture
def cifar_copy(tmp_path):
    make_cifar100(tmp_path, n_train=8, n_test=4, num_classes=100, seed=1)
    return tmp_path, tmp_path / "cifar-100-python"


def _expect_user_error(fn, *needles):
    with pytest.raises(UserError) as info:
        fn()
    msg = str(info.value)
    assert "\n" not in msg
    for needle in needles:
        assert str(needle) in msg, (needle, msg)
    return msg


def test_cifar_missing_folder_names_path_and_download(tmp_path):
    expected = os.path.join(str(tmp_path), "cifar-100-python")
    _expect_user_error(lambda: data.read_cifar100(str(tmp_path), True), expected, "--download")
    args = parse("--data-dir", str(tmp_path))
    _expect_user_error(lambda: data.load_datasets("cifar100", args), expected, "--download")


def _dump(path, obj):
    dump_cifar_pickle(path, obj)  # as the official files: pickle's own is refused (_codecs)


def _load(path):
    with open(path, "rb") as f:
        return pickle.load(f, encoding="bytes")


@pytest.mark.parametrize("damage", ["empty", "truncated", "not_pickle", "list", "no_data",
                                    "wrong_shape", "wrong_dtype", "label_count",
                                    "label_100", "label_negative", "missing_file"])
def test_cifar_malformed_gives_user_error_naming_path(cifar_copy, damage):
    root, folder = cifar_copy
    path = folder / "train"
    good = _load(path)
    raw = path.read_bytes()
    if damage == "empty":
        path.write_bytes(b"")
    elif damage == "truncated":
        path.write_bytes(raw[: len(raw) // 2])
    elif damage == "not_pickle":
        path.write_bytes(b"this is not a pickle\n" * 10)
    elif damage == "list":
        _dump(path, [good[b"data"], good[b"fine_labels"]])
    elif damage == "no_data":
        _dump(path, {b"fine_labels": good[b"fine_labels"]})
    elif damage == "wrong_shape":
        _dump(path, {**good, b"data": good[b"data"][:, :1000]})
    elif damage == "wrong_dtype":
        _dump(path, {**good, b"data": good[b"data"].astype(np.float32)})
    elif damage == "label_count":
        _dump(path, {**good, b"fine_labels": good[b"fine_labels"][:-1]})
    elif damage == "label_100":
        _dump(path, {**good, b"fine_labels": [100] + good[b"fine_labels"][1:]})
    elif damage == "label_negative":
        _dump(path, {**good, b"fine_labels": [-1] + good[b"fine_labels"][1:]})
    elif damage == "missing_file":
        path.unlink()
    msg = _expect_user_error(lambda: data.read_cifar100(str(root), True), path)
    assert "refused" not in msg  # the damage itself is found, not the way it was written
    # the test split is still fine
    assert len(data.read_cifar100(str(root), False)) == 4


# (damage, file, field): a structure as the files have it, a field of another type or range
CIFAR_FIELD_DAMAGE = [
    ("labels_an_int", "train", "fine_labels"), ("labels_strings", "train", "fine_labels"),
    ("label_2_pow_70", "train", "fine_labels"), ("labels_floats", "train", "fine_labels"),
    ("labels_bools", "train", "fine_labels"), ("labels_empty", "train", "fine_labels"),
    ("data_a_list", "train", "data"), ("data_bytes", "train", "data"),
    ("data_3d", "train", "data"), ("data_int16", "train", "data"),
    ("names_an_int", "meta", "fine_label_names"), ("names_ints", "meta", "fine_label_names"),
    ("names_a_string", "meta", "fine_label_names"), ("names_99", "meta", "fine_label_names"),
]


@pytest.mark.parametrize("damage,name,field", CIFAR_FIELD_DAMAGE,
                         ids=[d for d, _, _ in CIFAR_FIELD_DAMAGE])
def test_cifar_field_of_wrong_type_names_file_and_field(cifar_copy, damage, name, field):
    root, folder = cifar_copy
    path = folder / name
    train, meta = _load(folder / "train"), _load(folder / "meta")
    labels, pixels, names = train[b"fine_labels"], train[b"data"], meta[b"fine_label_names"]
    bad = {"labels_an_int": 5, "labels_strings": [str(y) for y in labels],
           "label_2_pow_70": [2 ** 70] + labels[1:],
           "labels_floats": [y + 0.5 for y in labels],  # torch would truncate them
           "labels_bools": [True] * len(labels), "labels_empty": [],
           "data_a_list": pixels.tolist(), "data_bytes": pixels.tobytes(),
           "data_3d": pixels.reshape(-1, 3, 1024), "data_int16": pixels.astype(np.int16),
           "names_an_int": 5, "names_ints": list(range(100)),
           "names_a_string": "x" * 100, "names_99": names[:99]}[damage]
    _dump(path, {**(train if name == "train" else meta), field.encode(): bad})
    msg = _expect_user_error(lambda: data.read_cifar100(str(root), True), path,
                             f"b'{field}'", "--download")
    assert "refused" not in msg


def test_cifar_meta_damaged(cifar_copy):
    root, folder = cifar_copy
    (folder / "meta").write_bytes(b"")
    _expect_user_error(lambda: data.read_cifar100(str(root), True), folder / "meta")


# ------------------------------------------------------------------------------ TinyImageNet

def _val_annotations(root):
    lines = (root / "tiny-imagenet-200" / "val" / "val_annotations.txt").read_text().splitlines()
    return [line.split("\t") for line in lines if line.strip()]


def test_tiny_labels_follow_sorted_wnids_and_images(tiny_dir):
    root = tiny_dir / "tiny-imagenet-200"
    wnids = [w.strip() for w in (root / "wnids.txt").read_text().split()]
    assert wnids != sorted(wnids)  # the generator's list is unsorted on purpose
    train_files, val_files, classes = data.tinyimagenet_files(str(tiny_dir))
    assert classes == sorted(wnids)
    train, val = data.read_tinyimagenet(str(tiny_dir), workers=0)
    assert train.classes == sorted(wnids)
    assert train.images.shape == (24, 3, 64, 64) and val.images.shape == (12, 3, 64, 64)
    assert train.images.dtype == torch.uint8 and train.labels.dtype == torch.int64
    # every training file sits in the folder of the wnid its label names
    for (path, label), y in zip(train_files, train.labels.tolist()):
        assert label == y
        assert os.path.basename(os.path.dirname(os.path.dirname(path))) == sorted(wnids)[y]
    # every decoded image carries its label
    for s in (train, val):
        assert [tiny_label_from_image(img) for img in s.images] == s.labels.tolist()
    assert sorted(set(train.labels.tolist())) == [0, 1, 2, 3]


def test_tiny_val_split_matches_annotations(tiny_dir):
    root = tiny_dir / "tiny-imagenet-200"
    classes = sorted((root / "wnids.txt").read_text().split())
    _, val_files, _ = data.tinyimagenet_files(str(tiny_dir))
    ann = _val_annotations(tiny_dir)
    assert len(val_files) == len(ann) == 12
    for (path, label), fields in zip(val_files, ann):
        assert os.path.samefile(path, root / "val" / "images" / fields[0])
        assert label == classes.index(fields[1])
    _, val = data.read_tinyimagenet(str(tiny_dir), workers=0)
    assert val.labels.tolist() == [classes.index(f[1]) for f in ann]


def test_tiny_grayscale_images_become_three_equal_channels(tiny_dir):
    from PIL import Image
    train_files, _, _ = data.tinyimagenet_files(str(tiny_dir))
    train, _ = data.read_tinyimagenet(str(tiny_dir), workers=0)
    gray = 0
    for (path, _), img in zip(train_files, train.images):
        with Image.open(path) as f:
            mode = f.mode
            pixels = np.asarray(f.convert("RGB")).transpose(2, 0, 1)
        assert img.shape == (3, 64, 64)
        assert np.array_equal(img.numpy(), pixels)
        if mode == "L":
            gray += 1
            assert torch.equal(img[0], img[1]) and torch.equal(img[1], img[2])
    assert gray >= 4  # the generator writes one grayscale image per class


def test_tiny_files_untouched(tmp_path):
    make_tinyimagenet(tmp_path, n_classes=3, n_train_per_class=2, n_val_per_class=2, seed=3)

    def dirs():
        return sorted(os.path.relpath(d, tmp_path) for d, _, _ in os.walk(tmp_path))

    before, before_dirs = snapshot_tree(tmp_path), dirs()
    args = parse("--data-dir", str(tmp_path), "--workers", "0")
    train, test = data.load_datasets("tinyimagenet", args)
    assert len(train) == 6 and len(test) == 6
    assert snapshot_tree(tmp_path) == before
    assert dirs() == before_dirs


_CONCURRENT = r"""
import hashlib, json, sys
sys.path.insert(0, sys.argv[1])
from common import data
train, val = data.read_tinyimagenet(sys.argv[2], workers=0)
files = data.tinyimagenet_files(sys.argv[2])
h = hashlib.sha1()
for s in (train, val):
    h.update(s.images.numpy().tobytes()); h.update(s.labels.numpy().tobytes())
print(json.dumps({"hash": h.hexdigest(), "files": files, "n": [len(train), len(val)]}))
"""


def test_tiny_two_processes_at_once(tmp_path):
    make_tinyimagenet(tmp_path, n_classes=3, n_train_per_class=3, n_val_per_class=3, seed=4)
    before = snapshot_tree(tmp_path)
    procs = [subprocess.Popen([sys.executable, "-c", _CONCURRENT, REPO, str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert results[0] == results[1]
    assert results[0]["n"] == [9, 9]
    assert snapshot_tree(tmp_path) == before


@pytest.fixture
def tiny_copy(tmp_path):
    make_tinyimagenet(tmp_path, n_classes=2, n_train_per_class=1, n_val_per_class=2, seed=5)
    return tmp_path, tmp_path / "tiny-imagenet-200"


def test_tiny_missing_tree_names_path_and_download(tmp_path):
    args = parse("--data-dir", str(tmp_path))
    _expect_user_error(lambda: data.load_datasets("tinyimagenet", args),
                       os.path.join(str(tmp_path), "tiny-imagenet-200"), "--download")


def test_tiny_missing_val_annotations(tiny_copy):
    root, tree = tiny_copy
    ann = tree / "val" / "val_annotations.txt"
    ann.unlink()
    _expect_user_error(lambda: data.tinyimagenet_files(str(root)), ann)


@pytest.mark.parametrize("damage", ["wnids_empty", "one_train_folder_empty",
                                    "all_train_folders_empty", "val_annotations_empty"])
def test_tiny_without_images_names_what_holds_none(tiny_copy, damage):
    """Not an epoch of 0 images: training would divide by 0, testing would report 0.00%."""
    root, tree = tiny_copy
    wnids = sorted((tree / "wnids.txt").read_text().split())
    folders = [tree / "train" / w / "images" for w in wnids]
    if damage == "wnids_empty":
        named = tree / "wnids.txt"
        named.write_bytes(b"")
    elif damage == "val_annotations_empty":
        named = tree / "val" / "val_annotations.txt"
        named.write_bytes(b"")
    else:
        emptied = folders if damage == "all_train_folders_empty" else folders[1:]
        for folder in emptied:
            for image in folder.iterdir():
                image.unlink()
        named = emptied[0]
    _expect_user_error(lambda: data.tinyimagenet_files(str(root)), named)
    args = parse("--data-dir", str(root), "--workers", "0")
    _expect_user_error(lambda: data.load_datasets("tinyimagenet", args), named)


@pytest.mark.parametrize("name", ["wnids.txt", "val/val_annotations.txt"])
def test_tiny_text_file_not_utf8(tiny_copy, name):
    root, tree = tiny_copy
    path = tree / name
    raw = path.read_bytes()
    path.write_bytes(raw[:3] + b"\xff" + raw[3:])  # in the first wnid or file name
    _expect_user_error(lambda: data.tinyimagenet_files(str(root)), path, "UTF-8")


@pytest.mark.parametrize("how", DAMAGED_IMAGES)
def test_tiny_undecodable_image_names_file(tiny_copy, how):
    """Every way PIL fails, not only its OSErrors: a decompression bomb (a header declaring
    60000 x 60000 pixels), a PNG text chunk too large or a bad PPM header (ValueError)."""
    root, tree = tiny_copy
    train_files, val_files, _ = data.tinyimagenet_files(str(root))
    for path in (train_files[1][0], val_files[0][0]):
        original = open(path, "rb").read()
        write_damaged_image(path, how)
        msg = _expect_user_error(lambda: data.read_tinyimagenet(str(root), workers=0), path,
                                 "cannot decode image")
        if how.startswith("bomb"):
            assert "DecompressionBombError" in msg
        open(path, "wb").write(original)
    assert len(data.read_tinyimagenet(str(root), workers=0)[0]) == 2


def test_tiny_val_label_not_in_wnids(tiny_copy):
    root, tree = tiny_copy
    ann = tree / "val" / "val_annotations.txt"
    lines = ann.read_text().splitlines(keepends=True)
    fields = lines[2].split("\t")
    fields[1] = "n99999999"
    lines[2] = "\t".join(fields)
    ann.write_text("".join(lines))
    msg = _expect_user_error(lambda: data.tinyimagenet_files(str(root)), ann, "n99999999")
    assert ":3" in msg  # the line number


# ------------------------------------------------------------------------------ image folders

@pytest.fixture
def folder_copy(tmp_path):
    return make_imagefolder(tmp_path, n_classes=2, n_train_per_class=2, n_val_per_class=1,
                            size=40, seed=6)


@pytest.mark.parametrize("how", ["garbage", "truncated-jpeg", "bomb-jpeg", "bad-ppm-header"])
def test_imagefolder_undecodable_image_names_file(folder_copy, how):
    train, val = data.read_imagefolder(str(folder_copy), 32)
    for dataset in (train, val):
        path = dataset.samples[1][0]
        write_damaged_image(path, how)
        assert dataset[0][0].shape == (3, 32, 32)  # the others still load
        _expect_user_error(lambda: dataset[1], path, "cannot decode image")


def test_imagefolder_undecodable_image_in_a_worker_is_one_line(folder_copy, capfd):
    """Raised mid-epoch in a DataLoader worker process: still the one line, exit status 2."""
    train, _ = data.read_imagefolder(str(folder_copy), 32)
    path = write_damaged_image(train.samples[2][0], "garbage")
    loader = torch.utils.data.DataLoader(train, batch_size=2, num_workers=1)

    def main():
        for _ in loader:
            pass

    with pytest.raises(SystemExit) as exit_:
        run_module.execute(main)
    assert exit_.value.code == 2
    lines = capfd.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}: cannot decode image"), lines


# ------------------------------------------------------------------------------ DeviceLoader

def _id_set(n, size=8, seed=0, low=1):
    """n random images (pixels >= `low`), labelled 0..n-1 so batches reveal sample ids."""
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(low, 256, (n, 3, size, size), dtype=torch.uint8, generator=g)
    return data.ImageSet(images, torch.arange(n), [str(i) for i in range(n)])


# mean 0 and std 1/255: the loader's normalisation is then the identity on pixel values
RAW = dict(mean=(0.0, 0.0, 0.0), std=(1 / 255, 1 / 255, 1 / 255))


def _collect(loader, epoch=None):
    if epoch is not None:
        loader.set_epoch(epoch)
    xs, ys = [], []
    for x, y in loader:
        xs.append(x)
        ys.append(y)
    return torch.cat(xs), torch.cat(ys)


def test_train_sampler_shards_cover_each_sample_once_per_epoch():
    ds = _id_set(20)
    orders = []
    for epoch in range(3):
        ids = []
        for rank in range(2):
            loader = DeviceLoader(ds, 3, "cpu", train=True, rank=rank, world_size=2,
                                  seed=7, **RAW)
            loader.set_epoch(epoch)
            assert len(loader) == 4  # ceil(10 / 3)
            _, y = _collect(loader)
            assert len(y) == 10
            ids.append(y.tolist())
        assert sorted(ids[0] + ids[1]) == list(range(20))
        orders.append(ids[0] + ids[1])
    assert orders[0] != orders[1] and orders[1] != orders[2]
    # the same epoch gives the same order again (resumable)
    loader = DeviceLoader(ds, 3, "cpu", train=True, rank=0, world_size=2, seed=7, **RAW)
    assert _collect(loader, 1)[1].tolist() == orders[1][:10]


def test_a_loaders_length_draws_no_permutation(monkeypatch):
    """len(loader) is read by every training loop and progress count: it is the shard's size
    over the batch, not a shuffle of the whole data set at each call."""
    loader = DeviceLoader(_id_set(20), 3, "cpu", train=True, rank=1, world_size=2, **RAW)
    drawn = []
    monkeypatch.setattr(torch, "randperm", lambda *a, **k: drawn.append(a) or 1 / 0)
    assert len(loader) == 4 and drawn == []  # ceil(10 / 3)
    tests = DeviceLoader(_id_set(11), 4, "cpu", train=False, rank=1, world_size=2, **RAW)
    assert len(tests) == 2  # samples 1, 3, ..., 9


def test_test_loader_covers_each_sample_once_without_padding():
    ds = _id_set(11)
    ids = []
    for rank in range(2):
        loader = DeviceLoader(ds, 4, "cpu", train=False, rank=rank, world_size=2, **RAW)
        x, y = _collect(loader)
        ids += y.tolist()
        # images belong to their ids (no shuffling mix-up)
        assert torch.equal(x, ds.images[y].float())
    assert sorted(ids) == list(range(11)) and len(ids) == 11


def _crop_flip_candidates(img, pad):
    """Every crop (zero padding `pad`) of `img`, with and without a horizontal flip."""
    c, h, w = img.shape
    padded = F.pad(img, (pad, pad, pad, pad))
    out = {}
    for dy in range(2 * pad + 1):
        for dx in range(2 * pad + 1):
            crop = padded[:, dy:dy + h, dx:dx + w]
            out[(dy, dx, False)] = crop
            out[(dy, dx, True)] = crop.flip(-1)
    return out


def _which_crop(aug, original, pad):
    hits = [k for k, v in _crop_flip_candidates(original, pad).items() if torch.equal(v, aug)]
    assert hits, "augmented image is no zero-padded crop/flip of its original"
    return hits[0]


def test_augmentation_is_random_zero_padded_crop_and_flip():
    ds = _id_set(48, size=16, seed=1)
    pad = 16 // 8
    loader = DeviceLoader(ds, 16, "cpu", train=True, seed=3, **RAW)
    assert loader.pad == pad
    crops = {}
    for epoch in range(2):
        loader.set_epoch(epoch)
        seen = 0
        for x, y in loader:
            assert x.dtype == torch.float32 and x.shape == (16, 3, 16, 16)
            batch = [_which_crop(img, ds.images[i].float(), pad) for img, i in zip(x, y.tolist())]
            # per-sample randomness within every batch: vertical and horizontal offsets and
            # flips each vary (not one draw for the whole batch)
            assert len({k[0] for k in batch}) > 1 and len({k[1] for k in batch}) > 1
            assert {k[2] for k in batch} == {False, True}
            crops.update({(epoch, i): k for i, k in zip(y.tolist(), batch)})
            seen += len(y)
        assert seen == 48
    epoch0 = [crops[0, i] for i in range(48)]
    # many different offsets, shifted crops (which show the zero padding), not only the centre
    assert len({k[:2] for k in epoch0}) >= 10
    assert sum(k[:2] != (pad, pad) for k in epoch0) >= 24
    # a different epoch draws different crops for the same samples
    assert sum(crops[0, i] != crops[1, i] for i in range(48)) >= 24


def test_test_batches_not_augmented_and_normalised():
    ds = _id_set(10, size=8, seed=2, low=0)
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    loader = DeviceLoader(ds, 4, "cpu", train=False, mean=mean, std=std, auto_augment="ta_wide")
    x, y = _collect(loader)
    assert y.tolist() == list(range(10))
    m = torch.tensor(mean).view(1, 3, 1, 1)
    s = torch.tensor(std).view(1, 3, 1, 1)
    expected = (ds.images.float() / 255 - m) / s
    torch.testing.assert_close(x, expected, rtol=1e-5, atol=1e-5)
    # the training loader normalises with the same statistics (crop/flip aside)
    train = DeviceLoader(ds, 10, "cpu", train=True, mean=mean, std=std, pad=0)
    xt, yt = _collect(train, 0)
    for img, i in zip(xt, yt.tolist()):
        e = expected[i]
        assert torch.allclose(img, e, atol=1e-5) or torch.allclose(img, e.flip(-1), atol=1e-5)


def _batches_and_masks(loader, epoch, start):
    """Batch k's images and the dropout masks its forward pass would draw, for k >= `start`."""
    return [(x, torch.nn.functional.dropout(torch.ones(64), 0.5))
            for x, _ in loader.epoch_batches(epoch, start)]


@pytest.mark.parametrize("kind", ["in-memory", "image-folder"])
@pytest.mark.parametrize("auto_augment", ["none", "ta_wide"])
def test_a_resumed_epoch_draws_each_batchs_crops_flips_and_dropout_masks_again(
        kind, auto_augment, imagefolder_dir):
    """A run stopped after batch 2 resumes at batch 3 (`epoch_batches(epoch, start=3)`): batch
    k must come with the same crops, flips, TrivialAugment operations and dropout masks as in
    the uninterrupted epoch, or a resumed run is not the run it continues.  An image folder's
    samples are augmented by 2 decoding processes, whichever gets them; another rank draws
    other masks."""
    if kind == "in-memory":
        def loader(rank=0):
            return DeviceLoader(_id_set(40, size=16), 4, "cpu", train=True, seed=3, rank=rank,
                                world_size=2, auto_augment=auto_augment, **RAW)
    else:
        train_set, _ = data.read_imagefolder(str(imagefolder_dir), 32, auto_augment)
        def loader(rank=0):
            return FolderLoader(train_set, 1, "cpu", train=True, workers=2, seed=3, rank=rank,
                                world_size=2, **RAW)
    whole, resumed = _batches_and_masks(loader(), 1, 0), _batches_and_masks(loader(), 1, 3)
    assert len(resumed) == len(whole) - 3 >= 2
    for (x, mask), (x_again, mask_again) in zip(whole[3:], resumed):
        assert torch.equal(x, x_again)
        assert torch.equal(mask, mask_again)
    other_rank = _batches_and_masks(loader(rank=1), 1, 3)
    assert not torch.equal(resumed[0][1], other_rank[0][1])


def test_trivial_augment_changes_training_images_after_the_crop_and_flip(imagefolder_dir):
    """--auto-augment ta_wide: the same crops and flips as without it, then most groups of 8
    images changed by one operation each (a new draw every epoch and batch); labels, shapes
    and the pixel range kept.  An image folder gets torchvision's transform per sample."""
    def batches(auto_augment, epoch):
        loader = DeviceLoader(_id_set(64, size=16), 32, "cpu", train=True, seed=5,
                              auto_augment=auto_augment, **RAW)
        return list(loader.epoch_batches(epoch))
    for epoch in (0, 1):
        for (x, y), (x_ta, y_ta) in zip(batches("none", epoch), batches("ta_wide", epoch)):
            assert torch.equal(y, y_ta) and x_ta.shape == x.shape
            assert x_ta.min() >= 0 and x_ta.max() <= 255
            changed = (x_ta != x).flatten(1).any(1).view(-1, 8)
            assert changed.any(1).sum() >= 2  # of 4 groups; each draws the identity 1 in 14
    first = [x for x, _ in batches("ta_wide", 0)]
    assert not all(torch.equal(a, b) for a, b in zip(first, [x for x, _ in batches("ta_wide", 1)]))
    train_set, _ = data.read_imagefolder(str(imagefolder_dir), 32, "ta_wide")
    assert any(type(t).__name__ == "TrivialAugmentWide" for t in train_set.transform.transforms)
    plain, _ = data.read_imagefolder(str(imagefolder_dir), 32)
    assert not any(type(t).__name__ == "TrivialAugmentWide" for t in plain.transform.transforms)


def test_trivial_augment_draws_one_operation_per_group_of_8_images():
    """TrivialAugmentWide one draw per 8 images (a few calls a batch, not one per image, nor one
    for the whole batch): copies of one photo, which no crop or flip changes, come back alike
    within each group of 8 and differ between groups."""
    photo = _id_set(1, size=16).images
    photo = torch.maximum(photo, photo.flip(3))  # a mirror image of itself: flips change nothing
    copies = data.ImageSet(photo.expand(128, -1, -1, -1).contiguous(),
                           torch.zeros(128, dtype=torch.int64), ["0"])
    loader = DeviceLoader(copies, 128, "cpu", train=True, pad=0, auto_augment="ta_wide", **RAW)
    x, _ = next(loader.epoch_batches(0))
    groups = [{img.numpy().tobytes() for img in group} for group in x.split(8)]
    assert all(len(group) == 1 for group in groups)
    assert len(set().union(*groups)) >= 8  # of 16 groups (the identity is 1 choice in 14)


def test_auto_augment_flag_reaches_the_training_batches_only(tmp_path):
    """`--auto-augment ta_wide` through make_loader: training batches change, test batches
    do not."""
    from common.loader import make_loader
    run = run_module.Run("test", str(tmp_path), torch.device("cpu"), False)

    def first_batches(*flag):
        args = parse("--batch-size", "16", *flag)
        train, test = (make_loader(images, args, run, train=train)
                       for images, train in ((_id_set(32), True), (_id_set(8), False)))
        return next(train.epoch_batches(0))[0], next(iter(test))[0]
    (train, test) = first_batches("--auto-augment", "none")
    (train_ta, test_ta) = first_batches("--auto-augment", "ta_wide")
    assert not torch.equal(train, train_ta) and torch.equal(test, test_ta)


def test_image_size_resizes():
    ds = _id_set(4, size=8, seed=3)
    # constant colour per image: resizing keeps the value everywhere
    ds.images[:] = ds.images[:, :, :1, :1]
    for train in (False, True):
        loader = DeviceLoader(ds, 4, "cpu", train=train, image_size=20, pad=0, **RAW)
        x, y = _collect(loader, 0)
        assert x.shape == (4, 3, 20, 20)
        torch.testing.assert_close(x, ds.images[y].float()[:, :, :1, :1].expand(4, 3, 20, 20))
    # a real picture: the resized batch is a smooth upsampling (mean nearly kept)
    ds = _id_set(2, size=8, seed=4)
    x, _ = _collect(DeviceLoader(ds, 2, "cpu", train=False, image_size=32, **RAW))
    assert x.shape == (2, 3, 32, 32)
    assert abs(x.mean().item() - ds.images.float().mean().item()) < 3.0


# ------------------------------------------------------------------------------ --dummy, limits

@pytest.mark.parametrize("name,size,classes", [("cifar100", 32, 100), ("tinyimagenet", 64, 200)])
def test_dummy_shapes_and_classes(name, size, classes, tmp_path):
    args = parse("--dummy", "--data-dir", str(tmp_path / "nothing"),
                 "--train-limit", "300", "--test-limit", "7")
    train, test = data.load_datasets(name, args)
    assert train.images.shape == (300, 3, size, size) and test.images.shape == (7, 3, size, size)
    assert train.images.dtype == torch.uint8
    assert len(train.classes) == classes
    assert 0 <= train.labels.min() and train.labels.max() < classes
    assert len(set(train.labels.tolist())) > 50  # labels spread over the classes
    assert not os.path.exists(tmp_path / "nothing")
    spec = data.SPECS[name]
    assert (spec.num_classes, spec.image_size) == (classes, size)
    assert (spec.train_size, spec.test_size) == ((50_000, 10_000) if name == "cifar100"
                                                 else (100_000, 10_000))


def _rows_of(subset, full):
    """Where each image of `subset` sits in `full` (images are unique in the generated sets)."""
    flat = full.images.reshape(len(full), -1)
    found = [int(torch.nonzero((flat == img.reshape(-1)).all(1))[0]) for img in subset.images]
    assert torch.equal(full.labels[found], subset.labels)
    return found


def test_limits_take_a_balanced_seeded_subset_cifar(cifar_dir):
    """200 training images of 100 classes (2 each), 100 test images (1 each)."""
    base = ("--data-dir", str(cifar_dir))
    full_train, full_test = data.load_datasets("cifar100", parse(*base))
    train, test = data.load_datasets("cifar100", parse(*base, "--train-limit", "130",
                                                       "--test-limit", "40"))
    assert (len(train), len(test)) == (130, 40)
    # every class once, then 30 classes twice; 40 test classes, all among the training ones
    assert sorted(torch.bincount(train.labels, minlength=100).tolist()) == [1] * 70 + [2] * 30
    assert len(set(test.labels.tolist())) == 40
    assert set(test.labels.tolist()) <= set(train.labels.tolist())
    rows = _rows_of(train, full_train)
    assert rows != list(range(130))  # not simply the first samples
    assert rows == sorted(set(rows))  # distinct samples, in the data set's order
    _rows_of(test, full_test)
    again, _ = data.load_datasets("cifar100", parse(*base, "--train-limit", "130"))
    other, _ = data.load_datasets("cifar100", parse(*base, "--train-limit", "130", "--seed", "1"))
    assert torch.equal(again.images, train.images)  # the same seed: the same subset
    assert not torch.equal(other.images, train.images)


def test_limits_take_a_balanced_subset_tiny_decoding_only_those(tiny_dir, monkeypatch):
    """4 classes, 6 training and 3 validation images each; the limit picks files, then decodes."""
    base = ("--data-dir", str(tiny_dir), "--workers", "0")
    full_train, full_test = data.load_datasets("tinyimagenet", parse(*base))
    decoded = []
    decode = data.decode_images
    monkeypatch.setattr(data, "decode_images",
                        lambda paths, *a: decoded.append(len(paths)) or decode(paths, *a))
    train, test = data.load_datasets("tinyimagenet", parse(*base, "--train-limit", "9",
                                                            "--test-limit", "4"))
    assert decoded == [9, 4]
    assert sorted(torch.bincount(train.labels, minlength=4).tolist()) == [2, 2, 2, 3]
    assert torch.bincount(test.labels, minlength=4).tolist() == [1, 1, 1, 1]
    _rows_of(train, full_train), _rows_of(test, full_test)  # the right image for each label


def test_limits_take_a_balanced_subset_imagefolder(imagefolder_dir):
    """3 classes, 4 training and 2 validation images each."""
    base = ("--data-dir", str(imagefolder_dir), "--dataset", "imagefolder")
    args = flags.make_parser("test", "test", resnet_cifar100.RECIPE, dataset="imagefolder",
                             arch="hw4")
    train, test = data.load_datasets("imagefolder", args.parse_args(
        [*base, "--train-limit", "6", "--test-limit", "3"]))
    assert sorted(train.targets) == [0, 0, 1, 1, 2, 2] and sorted(test.targets) == [0, 1, 2]
    assert train.imgs == train.samples and [y for _, y in train.samples] == train.targets
    assert all(f"/{train.classes[y]}/" in path for path, y in train.samples + test.samples)


def test_dummy_limits_train_and_test_on_the_same_classes(tmp_path):
    args = parse("--dummy", "--data-dir", str(tmp_path), "--train-limit", "60",
                 "--test-limit", "20")
    train, test = data.load_datasets("cifar100", args)
    assert torch.bincount(train.labels, minlength=100).max() == 1 and len(set(
        train.labels.tolist())) == 60
    assert set(test.labels.tolist()) <= set(train.labels.tolist())


def test_help_shows_a_default_of_zero_and_hides_none_and_false():
    """`--help` shows each flag's default except an unset None or a store_true's False; a
    default of 0 (--seed) is a real value and is shown (0 == False must not hide it)."""
    text = " ".join(parser().format_help().split())
    assert re.search(r"--seed SEED .*?\(default: 0\)", text)
    assert re.search(r"--lr LR .*?\(default: 0\.1\)", text)
    dummy = re.search(r"--dummy (.*?) --train-limit", text).group(1)
    assert "default" not in dummy  # False: not shown


@pytest.mark.parametrize("script", ["resnet_cifar100", "resnet_tinyimagenet", "pretrained_cifar100",
                                    "sync_sgd_cifar100", "async_sgd_cifar100", "report"])
def test_help_lays_out_the_docstring_as_written(script, capsys):
    """`--help` opens with the script's docstring as written: its command lines stay one per
    line and its indented blocks keep their indent (argparse's default reflows them into one
    unreadable paragraph)."""
    module = importlib.import_module(script)
    with pytest.raises(SystemExit) as exit_:
        module.parse_args(["--help"])
    assert exit_.value.code == 0
    shown = capsys.readouterr().out.splitlines()
    indented = [line for line in module.__doc__.splitlines() if line.startswith("    ")]
    assert indented, f"{script}: its docstring shows no command line"
    for line in indented:
        assert line.rstrip() in shown, f"{script} --help lost the line {line.strip()!r}"
