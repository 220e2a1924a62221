"""Generators of small, deterministic data sets in the real on-disk formats.

Used by the test-suite only.  Everything is seeded (``numpy.random.Generator``)
and small enough to build in a fraction of a second.

Label encodings (so tests can check that loaders pair images with labels):

* CIFAR-100: red channel, row 0, col 0 holds the fine label
  (:func:`cifar_label_from_image`).  The rest of the image is a class
  prototype (base colour + coarse 4x4 pattern) plus a little noise.
* TinyImageNet (and :func:`make_imagefolder`): the top half of the image is
  the code area, split into three horizontal bands (top to bottom, j=0,1,2).
  The class index ``k`` (position in SORTED wnid order, i.e. what
  ``torchvision.datasets.ImageFolder`` would assign) is written in base 6,
  ``k = d0 + 6*d1 + 36*d2`` (so at most 216 classes), with grey levels
  ``LEVELS[d] = 20 + 43*d`` (20, 63, 106, 149, 192, 235).

  - RGB images: the whole code area is one flat colour
    ``(LEVELS[d0], LEVELS[d1], LEVELS[d2])``.
  - Grayscale ('L') images: band j is flat grey ``LEVELS[dj]``.

  :func:`tiny_label_from_image` decides from the chroma of the code area which
  case applies (an RGB code with d0 == d1 == d2 is grey and decodes to the same
  k either way).  The code is invariant to horizontal flips and to resizing
  of the whole image; crops that cut the top half destroy it.
"""
from __future__ import annotations

import hashlib
import os
import pickle
import struct
from pathlib import Path

import numpy as np
from PIL import Image

__all__ = [
    "CIFAR100_FINE_LABEL_NAMES",
    "CIFAR100_COARSE_LABEL_NAMES",
    "TINY_LEVELS",
    "make_cifar100",
    "cifar_label_from_image",
    "make_tinyimagenet",
    "tiny_label_from_image",
    "tiny_code_image",
    "make_resnet18_weights",
    "make_imagefolder",
    "snapshot_tree",
]

# ----------------------------------------------------------------------------
# CIFAR-100
# ----------------------------------------------------------------------------

CIFAR100_FINE_LABEL_NAMES = (
    "apple aquarium_fish baby bear beaver bed bee beetle bicycle bottle bowl "
    "boy bridge bus butterfly camel can castle caterpillar cattle chair "
    "chimpanzee clock cloud cockroach couch crab crocodile cup dinosaur "
    "dolphin elephant flatfish forest fox girl hamster house kangaroo "
    "keyboard lamp lawn_mower leopard lion lizard lobster man maple_tree "
    "motorcycle mountain mouse mushroom oak_tree orange orchid otter "
    "palm_tree pear pickup_truck pine_tree plain plate poppy porcupine "
    "possum rabbit raccoon ray road rocket rose sea seal shark shrew skunk "
    "skyscraper snail snake spider squirrel streetcar sunflower "
    "sweet_pepper table tank telephone television tiger tractor train trout "
    "tulip turtle wardrobe whale willow_tree wolf woman worm"
).split()
assert len(CIFAR100_FINE_LABEL_NAMES) == 100

CIFAR100_COARSE_LABEL_NAMES = (
    "aquatic_mammals fish flowers food_containers fruit_and_vegetables "
    "household_electrical_devices household_furniture insects "
    "large_carnivores large_man-made_outdoor_things "
    "large_natural_outdoor_scenes large_omnivores_and_herbivores "
    "medium_mammals non-insect_invertebrates people reptiles small_mammals "
    "trees vehicles_1 vehicles_2"
).split()
assert len(CIFAR100_COARSE_LABEL_NAMES) == 20


def _fine_names(num_classes):
    if num_classes == 100:
        return list(CIFAR100_FINE_LABEL_NAMES)
    return ["class_%03d" % i for i in range(num_classes)]


def _cifar_prototypes(num_classes, rng):
    """Per-class 3x32x32 float prototypes: base colour + coarse 4x4 pattern."""
    base = rng.uniform(40, 215, size=(num_classes, 3, 1, 1))
    coarse = rng.uniform(-35, 35, size=(num_classes, 3, 4, 4))
    pattern = np.repeat(np.repeat(coarse, 8, axis=2), 8, axis=3)
    return base + pattern


def _marked_images(labels, protos, rng):
    """Class prototype + noise, with the label marker (R channel, row 0, col 0)."""
    n = len(labels)
    imgs = protos[labels] + rng.normal(0.0, 6.0, size=(n, 3, 32, 32))
    imgs = np.clip(np.rint(imgs), 0, 255).astype(np.uint8)
    imgs[:, 0, 0, 0] = labels
    return imgs.reshape(n, 3072)


def _cifar_split(data, labels, batch_label, num_classes):
    names = _fine_names(num_classes)
    return {
        b"batch_label": batch_label,
        b"fine_labels": [int(x) for x in labels],
        b"coarse_labels": [int(x) * 20 // num_classes for x in labels],
        b"data": np.ascontiguousarray(data, dtype=np.uint8).reshape(len(labels), 3072),
        b"filenames": [
            ("%s_s_%06d.png" % (names[int(lab)], i)).encode() for i, lab in enumerate(labels)
        ],
    }


class _Py2Pickler(pickle._Pickler):
    """Protocol-2 pickler writing ``bytes`` as Python 2 ``str`` opcodes
    (SHORT_BINSTRING / BINSTRING), as in the official CIFAR files: they load
    as ``bytes`` with ``encoding='bytes'`` and as ``str`` with
    ``encoding='latin1'`` (what torchvision uses)."""

    dispatch = dict(pickle._Pickler.dispatch)

    def _save_py2_str(self, obj):
        n = len(obj)
        if n < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([n]) + obj)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", n) + obj)
        self.memoize(obj)

    dispatch[bytes] = _save_py2_str


def _cycled_labels(n, num_classes, rng):
    labels = np.arange(n, dtype=np.int64) % num_classes
    rng.shuffle(labels)
    return labels


def write_cifar100_pickles(root, train, test, num_classes=100) -> Path:
    """Write ``root/cifar-100-python/{train,test,meta}`` like the official python version
    (Python-2-style protocol-2 pickles: keys and strings load as ``bytes`` with
    ``encoding='bytes'``, as ``str`` with ``'latin1'``); return the ``cifar-100-python``
    folder.  `train` and `test` are (uint8 data N x 3072, labels) pairs.  Coarse labels are a
    synthetic mapping ``fine * 20 // num_classes``."""
    out = Path(root) / "cifar-100-python"
    out.mkdir(parents=True, exist_ok=True)
    splits = {
        "train": _cifar_split(*train, b"training batch 1 of 1", num_classes),
        "test": _cifar_split(*test, b"testing batch 1 of 1", num_classes),
        "meta": {
            b"fine_label_names": [s.encode() for s in _fine_names(num_classes)],
            b"coarse_label_names": [s.encode() for s in CIFAR100_COARSE_LABEL_NAMES],
        },
    }
    for name, obj in splits.items():
        with open(out / name, "wb") as f:
            _Py2Pickler(f, protocol=2).dump(obj)
    return out


def make_cifar100(root, n_train=64, n_test=32, num_classes=100, seed=0) -> Path:
    """Write marker-pixel images in the CIFAR-100 layout (see `write_cifar100_pickles`).

    Labels are ``i % num_classes`` shuffled with the seed; the red pixel at
    (0, 0) of every image equals its fine label (see module docstring).
    """
    if not 1 <= num_classes <= 256:
        raise ValueError("num_classes must be in [1, 256] (label stored in a uint8 pixel)")
    rng = np.random.default_rng(seed)
    protos = _cifar_prototypes(num_classes, rng)
    splits = []
    for n in (n_train, n_test):
        labels = _cycled_labels(n, num_classes, rng)
        splits.append((_marked_images(labels, protos, rng), labels))
    return write_cifar100_pickles(root, *splits, num_classes=num_classes)


def _to_numpy_chw(img):
    """uint8-ish CHW numpy array from a tensor / array / PIL image."""
    if isinstance(img, Image.Image):
        arr = np.asarray(img)
        arr = arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1)
    else:
        if hasattr(img, "detach"):  # torch.Tensor
            img = img.detach().cpu().numpy()
        arr = np.asarray(img)
        if arr.ndim == 2:
            arr = arr[None]
    arr = arr.astype(np.float64)
    if arr.size and arr.max() <= 1.0 + 1e-6 and arr.min() >= 0.0 and not np.issubdtype(
        np.asarray(img).dtype, np.integer
    ):
        arr = arr * 255.0  # float image in [0, 1] (e.g. after ToTensor)
    return arr


def cifar_label_from_image(img) -> int:
    """Fine label of a generated CIFAR image (CHW uint8 tensor/array):
    channel 0, row 0, col 0."""
    return int(round(float(_to_numpy_chw(img)[0, 0, 0])))


# ----------------------------------------------------------------------------
# TinyImageNet
# ----------------------------------------------------------------------------

TINY_LEVELS = tuple(20 + 43 * d for d in range(6))  # 20, 63, ..., 235 (step 43)
_TINY_MAX_CLASSES = 6 ** 3


def _tiny_digits(k):
    if not 0 <= k < _TINY_MAX_CLASSES:
        raise ValueError("class index %d out of range [0, %d)" % (k, _TINY_MAX_CLASSES))
    return k % 6, (k // 6) % 6, k // 36


def _band_rows(height):
    """Row ranges [(start, stop)] of the three code bands in the top half."""
    h = height // 2
    return [(j * h // 3, (j + 1) * h // 3) for j in range(3)]


def tiny_code_image(k, rng, width=64, height=64, gray=False) -> Image.Image:
    """PIL image (mode 'RGB' or 'L') whose top half encodes class index ``k``;
    the bottom half is seeded noise texture."""
    d = _tiny_digits(k)
    img = np.zeros((height, width, 3), dtype=np.float64)
    bottom = height // 2
    # bottom half: smooth-ish random texture (class independent)
    coarse = rng.uniform(30, 225, size=(max(1, (height - bottom) // 8 + 1), width // 8 + 1, 3))
    tex = np.repeat(np.repeat(coarse, 8, axis=0), 8, axis=1)[: height - bottom, :width]
    img[bottom:] = tex + rng.normal(0, 10, size=tex.shape)
    if gray:
        g = img.mean(axis=2)
        for j, (r0, r1) in enumerate(_band_rows(height)):
            g[r0:r1] = TINY_LEVELS[d[j]]
        return Image.fromarray(np.clip(np.rint(g), 0, 255).astype(np.uint8), mode="L")
    img[:bottom] = np.array([TINY_LEVELS[x] for x in d], dtype=np.float64)
    return Image.fromarray(np.clip(np.rint(img), 0, 255).astype(np.uint8), mode="RGB")


def tiny_label_from_image(img) -> int:
    """Recover the sorted-wnid class index from a decoded image (CHW uint8
    tensor/array with 3 or 1 channels, float in [0, 1], or a PIL image).

    Works for RGB and grayscale-origin images, after horizontal flips and
    resizing of the whole image (see module docstring for the scheme).
    """
    arr = _to_numpy_chw(img)
    if arr.shape[0] == 1:
        arr = np.repeat(arr, 3, axis=0)
    _, height, width = arr.shape
    mx = max(1, width // 8)
    meds = []
    for r0, r1 in _band_rows(height):
        my = max(0, (r1 - r0) // 4)
        patch = arr[:, r0 + my: max(r0 + my + 1, r1 - my), mx: width - mx]
        meds.append(np.median(patch.reshape(3, -1), axis=1))
    meds = np.array(meds)  # (band, channel)
    levels = np.array(TINY_LEVELS, dtype=np.float64)

    def digit(v):
        return int(np.argmin(np.abs(levels - v)))

    chroma = np.abs(meds.max(axis=1) - meds.min(axis=1)).max()
    if chroma > 21.5:  # colour code: one flat colour, digits in R, G, B
        rgb = meds.mean(axis=0)
        d = [digit(v) for v in rgb]
    else:  # grey code: one digit per band
        d = [digit(v) for v in meds.mean(axis=1)]
    return d[0] + 6 * d[1] + 36 * d[2]


def _make_wnids(n, rng):
    nums = rng.choice(np.arange(1_000_000, 9_999_999), size=n, replace=False)
    wnids = ["n%08d" % x for x in nums]
    rng.shuffle(wnids)
    if n >= 2 and wnids == sorted(wnids):
        wnids[0], wnids[1] = wnids[1], wnids[0]
    return wnids


def _rand_box(rng, size):
    x0, y0 = (int(v) for v in rng.integers(0, size // 2, size=2))
    x1, y1 = (int(v) for v in rng.integers(size // 2, size, size=2))
    return x0, y0, x1, y1


def make_tinyimagenet(root, n_classes=4, n_train_per_class=6, n_val_per_class=3,
                      seed=0, size=64, draw=None) -> Path:
    """Write ``root/tiny-imagenet-200`` in the distributed layout; return it.

    ``wnids.txt`` is deliberately unsorted; the label encoded in each image is
    the index of its wnid in SORTED order.  Every image whose index (within its
    class for train, global for val/test) is 4 mod 5 is grayscale ('L').
    Val images are interleaved round-robin over classes in wnids.txt order.
    `draw(k, rng, size)`, if given, returns the uint8 CHW image of class k to
    write instead of the class code (tests/yardstick.py).
    """
    if not 1 <= n_classes <= _TINY_MAX_CLASSES:
        raise ValueError("n_classes must be in [1, %d]" % _TINY_MAX_CLASSES)
    rng = np.random.default_rng(seed)
    out = Path(root) / "tiny-imagenet-200"
    wnids = _make_wnids(n_classes, rng)
    index = {w: i for i, w in enumerate(sorted(wnids))}
    for sub in ("train", "val/images", "test/images"):
        (out / sub).mkdir(parents=True, exist_ok=True)

    (out / "wnids.txt").write_text("".join(w + "\n" for w in wnids))
    extra = _make_wnids(2, rng)  # words.txt covers more wnids than the data set
    words = [(w, "synthetic class %d, thing %s" % (index[w], w)) for w in wnids]
    words += [(w, "unused synset") for w in extra if w not in index]
    (out / "words.txt").write_text("".join("%s\t%s\n" % wv for wv in sorted(words)))

    def image(k, gray):
        if draw is None:
            return tiny_code_image(k, rng, size, size, gray=gray)
        img = Image.fromarray(np.ascontiguousarray(draw(k, rng, size).transpose(1, 2, 0)), "RGB")
        return img.convert("L") if gray else img

    def save(img, path):
        img.save(path, format="JPEG", quality=95)

    for w in wnids:
        cdir = out / "train" / w
        (cdir / "images").mkdir(parents=True, exist_ok=True)
        lines = []
        for i in range(n_train_per_class):
            fname = "%s_%d.JPEG" % (w, i)
            save(image(index[w], i % 5 == 4), cdir / "images" / fname)
            lines.append("%s\t%d\t%d\t%d\t%d\n" % ((fname,) + _rand_box(rng, size)))
        (cdir / ("%s_boxes.txt" % w)).write_text("".join(lines))

    val_lines = []
    order = [w for _ in range(n_val_per_class) for w in wnids]  # round-robin
    for k, w in enumerate(order):
        fname = "val_%d.JPEG" % k
        save(image(index[w], k % 5 == 4), out / "val" / "images" / fname)
        val_lines.append("%s\t%s\t%d\t%d\t%d\t%d\n" % ((fname, w) + _rand_box(rng, size)))
    (out / "val" / "val_annotations.txt").write_text("".join(val_lines))

    for k in range(n_classes * n_val_per_class):
        save(image(int(rng.integers(n_classes)), k % 5 == 4),
             out / "test" / "images" / ("test_%d.JPEG" % k))
    return out


# ----------------------------------------------------------------------------
# ResNet-18 weights
# ----------------------------------------------------------------------------

def make_resnet18_weights(path, num_classes=1000, seed=0) -> Path:
    """Save a seeded random ``torchvision.models.resnet18`` state_dict with
    ``torch.save`` (the format of torchvision's pretrained weight files).
    The global torch RNG state is left unchanged."""
    import torch
    import torchvision

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = torchvision.models.resnet18(num_classes=num_classes)
    torch.save(model.state_dict(), path)
    return path


# ----------------------------------------------------------------------------
# ImageNet-style ImageFolder tree
# ----------------------------------------------------------------------------

def make_imagefolder(root, n_classes=3, n_train_per_class=4, n_val_per_class=2,
                     size=80, seed=0) -> Path:
    """Write ``root/{train,val}/<wnid>/*.JPEG`` (RGB JPEGs, mostly
    ``size`` x ``size``; about one in three has another size/aspect ratio); return
    ``root``.  Images carry the TinyImageNet code of their sorted class index,
    so :func:`tiny_label_from_image` recovers it."""
    if not 1 <= n_classes <= _TINY_MAX_CLASSES:
        raise ValueError("n_classes must be in [1, %d]" % _TINY_MAX_CLASSES)
    rng = np.random.default_rng(seed)
    root = Path(root)
    classes = sorted(_make_wnids(n_classes, rng))
    odd_shapes = [(size * 3 // 2, size), (size, size * 4 // 3), (size // 2 + 7, size // 2 + 3)]
    count = 0
    for split, n in (("train", n_train_per_class), ("val", n_val_per_class)):
        for k, w in enumerate(classes):
            cdir = root / split / w
            cdir.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                count += 1
                wh = odd_shapes[(count // 3) % len(odd_shapes)] if count % 3 == 2 else (size, size)
                img = tiny_code_image(k, rng, wh[0], wh[1])
                name = ("%s_%d.JPEG" % (w, i)) if split == "train" else (
                    "ILSVRC2012_val_%08d.JPEG" % (k * n + i + 1))
                img.save(cdir / name, format="JPEG", quality=95)
    return root


# ----------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------

def snapshot_tree(path) -> dict:
    """Map each file's POSIX path relative to ``path`` to
    ``(size, mtime_ns, sha1_hex)``, to check a folder was left untouched."""
    path = Path(path)
    snap = {}
    for dirpath, _dirnames, filenames in os.walk(path):
        for fn in filenames:
            p = Path(dirpath) / fn
            st = p.stat()
            snap[p.relative_to(path).as_posix()] = (
                st.st_size, st.st_mtime_ns, hashlib.sha1(p.read_bytes()).hexdigest())
    return snap


# ----------------------------------------------------------------------------
# Damaged files (added: the readers' one-line errors)
# ----------------------------------------------------------------------------

def dump_cifar_pickle(path, obj) -> Path:
    """Pickle `obj` to `path` as the official CIFAR-100 files are (see
    `write_cifar100_pickles`): Python 3's own protocol 2 would write ``bytes``
    through ``_codecs.encode``, which the data reader's unpickler refuses."""
    path = Path(path)
    with open(path, "wb") as f:
        _Py2Pickler(f, protocol=2).dump(obj)
    return path


DAMAGED_IMAGES = ("truncated-jpeg", "garbage", "bomb-png", "bomb-jpeg", "png-text-bomb",
                  "bad-ppm-header")


def _png_chunk(kind, payload):
    import zlib
    crc = zlib.crc32(kind + payload)
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", crc)


def _png(width, height, before_idat=b""):
    """A PNG of 8 x 8 black RGB pixels whose header says ``width`` x ``height``."""
    import zlib
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    rows = b"".join(b"\0" + bytes(3 * 8) for _ in range(8))
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header) + before_idat
            + _png_chunk(b"IDAT", zlib.compress(rows)) + _png_chunk(b"IEND", b""))


def damaged_image_bytes(how, seed=0) -> bytes:
    """A file of at most a few kB that PIL fails to decode, `how` being one of
    DAMAGED_IMAGES: a JPEG cut in half (OSError), no image at all
    (UnidentifiedImageError), a PNG or JPEG whose header declares 60000 x 60000
    pixels (DecompressionBombError, before any pixel is allocated), a PNG whose
    zTXt chunk inflates to 2 MB, over PIL's MAX_TEXT_CHUNK (ValueError), a PPM
    whose header holds no number (ValueError)."""
    import io
    import zlib
    if how == "truncated-jpeg":
        buf = io.BytesIO()
        tiny_code_image(0, np.random.default_rng(seed)).save(buf, format="JPEG", quality=95)
        return buf.getvalue()[: len(buf.getvalue()) // 2]
    if how == "garbage":
        return b"this is not an image\n" * 20
    if how == "bomb-png":
        return _png(60_000, 60_000)
    if how == "bomb-jpeg":
        buf = io.BytesIO()
        Image.new("RGB", (8, 8)).save(buf, format="JPEG")
        raw = bytearray(buf.getvalue())
        sof = raw.index(b"\xff\xc0")  # marker, length (2), precision (1), height, width
        raw[sof + 5: sof + 9] = struct.pack(">HH", 60_000, 60_000)
        return bytes(raw)
    if how == "png-text-bomb":
        text = b"comment\0\0" + zlib.compress(bytes(2_000_000))
        return _png(8, 8, before_idat=_png_chunk(b"zTXt", text))
    if how == "bad-ppm-header":
        return b"P6\n6|\n8\n255\n" + bytes(3 * 64)
    raise ValueError("how must be one of %s" % (DAMAGED_IMAGES,))


def write_damaged_image(path, how, seed=0) -> Path:
    """Overwrite the image file at `path` with `damaged_image_bytes(how)`."""
    path = Path(path)
    path.write_bytes(damaged_image_bytes(how, seed))
    return path
