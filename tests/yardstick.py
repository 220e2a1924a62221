"""The yardstick: generated image classification that a ResNet cannot learn in one step.

Images that show their own label (tests/datagen.py's marker pixel) prove wiring, never
learning: every update rule, broken or not, scores 100% on them.  Here each class is a
combination of three factors, none of which is written anywhere in the image as such:

* shape   (5): disc, square, triangle, cross, ring
* texture (5): solid, stripes, checkerboard, dots, rings (concentric)
* colour  (4): red, green, blue, yellow families, each a wide hue range

100 classes = 5 x 5 x 4 (class k -> shape k % 5, texture k // 5 % 5, colour k // 25).
The object is drawn at a random position, scale and rotation on a random smooth background,
with a smaller, fainter distractor object of random factors beside it, global brightness and
contrast jitter, and pixel noise.  A network has to find the object, and read its shape,
texture and colour under that noise: a few epochs of a few thousand images land well above
chance (1%) and well below 100%, and a worse optimiser lands measurably lower.  Nothing is
downloaded; everything is seeded.

Written in the real on-disk formats: ``make_cifar100_yardstick`` (the CIFAR-100 python
pickles) and ``make_tinyimagenet_yardstick`` (the TinyImageNet-200 tree of JPEGs).
"""
from __future__ import annotations

import math

import numpy as np

SHAPES = ("disc", "square", "triangle", "cross", "ring")
TEXTURES = ("solid", "stripes", "checker", "dots", "rings")
# Hue centres (degrees) of the colour families; each image draws its hue within +-HUE_SPREAD.
HUES = (0.0, 120.0, 230.0, 55.0)
HUE_SPREAD = 22.0
NUM_CLASSES = len(SHAPES) * len(TEXTURES) * len(HUES)


def factors(k):
    """(shape, texture, colour) indices of class k."""
    return k % 5, (k // 5) % 5, k // 25


def _hsv_to_rgb(h, s, v):
    """Vectorised HSV (h in degrees, s and v in [0, 1]) to RGB in [0, 1], shape (..., 3)."""
    h = (h % 360.0) / 60.0
    c = v * s
    x = c * (1 - np.abs(h % 2 - 1))
    zero = np.zeros_like(h)
    sector = np.floor(h).astype(int) % 6
    table = [(c, x, zero), (x, c, zero), (zero, c, x), (zero, x, c), (x, zero, c), (c, zero, x)]
    rgb = np.zeros(h.shape + (3,))
    for i, (r, g, b) in enumerate(table):
        m = sector == i
        rgb[m] = np.stack([r[m], g[m], b[m]], axis=-1)
    return rgb + (v - c)[..., None]


def _shape_mask(shape, u, v):
    """Soft-edged mask (n, H, W) of `shape` in object coordinates u, v (unit radius)."""
    r = np.sqrt(u ** 2 + v ** 2)
    if shape == 0:    # disc
        d = r - 0.95
    elif shape == 1:  # square
        d = np.maximum(np.abs(u), np.abs(v)) - 0.8
    elif shape == 2:  # triangle, pointing up in object coordinates
        d = np.maximum(np.maximum(-v - 0.55, v - 0.95), np.abs(u) * 1.6 + v - 0.95)
    elif shape == 3:  # cross
        d = np.minimum(np.maximum(np.abs(u) - 0.32, np.abs(v) - 0.95),
                       np.maximum(np.abs(v) - 0.32, np.abs(u) - 0.95))
    else:             # ring
        d = np.abs(r - 0.7) - 0.27
    return np.clip(0.5 - d * 6.0, 0.0, 1.0)


def _texture(texture, u, v, freq, phase):
    """Texture (n, H, W) in [0, 1] (1 = full object colour) in object coordinates."""
    f, p = freq[:, None, None], phase[:, None, None]
    if texture == 0:  # solid
        return np.ones_like(u)
    if texture == 1:  # stripes
        return 0.5 + 0.5 * np.sign(np.sin(f * u + p))
    if texture == 2:  # checkerboard
        return 0.5 + 0.5 * np.sign(np.sin(f * u + p) * np.sin(f * v + p))
    if texture == 3:  # dots
        return (np.sin(f * u + p) * np.sin(f * v + p) > 0.45).astype(float)
    return 0.5 + 0.5 * np.sign(np.sin(1.3 * f * np.sqrt(u ** 2 + v ** 2) + p))  # rings


def _draw_objects(canvas, shape, texture, hue, size, rng, scale, contrast):
    """Paint one object per image, with the given factors, onto canvas (n, 3, H, W) in [0, 1]."""
    n = len(shape)
    yy, xx = np.meshgrid(np.arange(size) + 0.5, np.arange(size) + 0.5, indexing="ij")
    radius = size * rng.uniform(*scale, n)
    cx = rng.uniform(radius, size - radius)
    cy = rng.uniform(radius, size - radius)
    angle = rng.uniform(-math.pi / 5, math.pi / 5, n)
    ca, sa = np.cos(angle)[:, None, None], np.sin(angle)[:, None, None]
    dx = (xx[None] - cx[:, None, None]) / radius[:, None, None]
    dy = (yy[None] - cy[:, None, None]) / radius[:, None, None]
    u, v = ca * dx + sa * dy, -sa * dx + ca * dy
    freq = rng.uniform(6.0, 9.0, n)
    phase = rng.uniform(0, 2 * math.pi, n)
    colour = _hsv_to_rgb(hue, rng.uniform(0.55, 1.0, n), rng.uniform(0.6, 1.0, n))
    dark = colour * rng.uniform(0.15, 0.4, (n, 1))  # the texture's second tone
    for s in range(len(SHAPES)):
        for t in range(len(TEXTURES)):
            idx = np.flatnonzero((shape == s) & (texture == t))
            if len(idx) == 0:
                continue
            mask = _shape_mask(s, u[idx], v[idx]) * contrast[idx, None, None]
            tex = _texture(t, u[idx], v[idx], freq[idx], phase[idx])
            paint = (tex[:, None] * colour[idx, :, None, None]
                     + (1 - tex[:, None]) * dark[idx, :, None, None])
            canvas[idx] = canvas[idx] * (1 - mask[:, None]) + paint * mask[:, None]


def yardstick_images(labels, size=32, seed=0, noise=0.10):
    """uint8 images (n, 3, size, size) of the given class labels (see the module docstring)."""
    labels = np.asarray(labels, dtype=np.int64)
    if labels.size and (labels.min() < 0 or labels.max() >= NUM_CLASSES):
        raise ValueError(f"labels must be in [0, {NUM_CLASSES})")
    rng = np.random.default_rng(seed)
    n = len(labels)
    # Background: a random colour with a smooth random field (upsampled 4x4 noise) over it.
    base = _hsv_to_rgb(rng.uniform(0, 360, n), rng.uniform(0.0, 0.5, n), rng.uniform(0.2, 0.8, n))
    coarse = rng.normal(0, 0.12, (n, 3, 4, 4))
    reps = math.ceil(size / 4)
    field = np.repeat(np.repeat(coarse, reps, axis=2), reps, axis=3)[:, :, :size, :size]
    canvas = np.clip(base[:, :, None, None] + field, 0, 1)
    # A distractor: smaller and fainter, of random factors, drawn first (the object may cover it).
    _draw_objects(canvas, rng.integers(0, 5, n), rng.integers(0, 5, n),
                  rng.uniform(0, 360, n), size, rng, scale=(0.12, 0.2),
                  contrast=rng.uniform(0.3, 0.6, n))
    s, t, c = factors(labels)
    hue = np.asarray(HUES)[c] + rng.uniform(-HUE_SPREAD, HUE_SPREAD, n)
    _draw_objects(canvas, s, t, hue, size, rng, scale=(0.22, 0.4),
                  contrast=rng.uniform(0.75, 1.0, n))
    # Global brightness / contrast jitter and pixel noise.
    gain = rng.uniform(0.7, 1.2, (n, 1, 1, 1))
    bias = rng.uniform(-0.1, 0.1, (n, 1, 1, 1))
    out = canvas * gain + bias + rng.normal(0, noise, canvas.shape)
    return np.clip(np.rint(out * 255), 0, 255).astype(np.uint8)


def balanced_labels(n, num_classes, seed):
    """n labels, each class (nearly) equally often, in a seeded random order."""
    labels = np.arange(n) % num_classes
    np.random.default_rng(seed).shuffle(labels)
    return labels


def make_cifar100_yardstick(root, n_train=5000, n_test=2000, num_classes=NUM_CLASSES, seed=0,
                            noise=0.10):
    """Write ``root/cifar-100-python/{train,test,meta}`` (the official pickle layout) holding
    yardstick images; return that folder.  Labels use the first `num_classes` classes; the meta
    file names all 100 (as CIFAR-100's does), so the scripts build a 100-way head."""
    from datagen import write_cifar100_pickles
    splits = {}
    for split, n, offset in (("train", n_train, 0), ("test", n_test, 1)):
        labels = balanced_labels(n, num_classes, seed * 2 + offset)
        images = yardstick_images(labels, 32, seed * 2 + offset + 1000, noise)
        splits[split] = (images.reshape(n, -1), labels)
    return write_cifar100_pickles(root, splits["train"], splits["test"])


def make_tinyimagenet_yardstick(root, n_classes=20, n_train_per_class=50, n_val_per_class=20,
                                seed=0, noise=0.10):
    """Write ``root/tiny-imagenet-200`` (the distributed tree of 64x64 JPEGs) holding yardstick
    images of the first `n_classes` classes; the class of sorted wnid k is yardstick class k."""
    from datagen import make_tinyimagenet

    def draw(k, rng, size):
        return yardstick_images([k], size, int(rng.integers(2**31)), noise)[0]
    return make_tinyimagenet(root, n_classes, n_train_per_class, n_val_per_class, seed=seed,
                             draw=draw)
