"""The field's regularisers for bench/recipes.py to try, as the scripts' crop and flip are
done: on the training device, each image drawn its own way, in a few tensor operations for the
whole batch, not a Python call per image (torchvision's per-image transforms on 128 CPU images
cost a third of a training step).  Every draw comes from the batch's generator, so a batch is
augmented alike whether or not its epoch was interrupted."""
import math

import torch
import torch.nn.functional as F


# ---------------------------------------------------------------------------- TrivialAugment
# TrivialAugment (Mueller & Hutter, 2021) as torchvision's TrivialAugmentWide: each image gets
# one operation, drawn uniformly, at a strength m drawn uniformly from 31 steps of [0, 1] (and
# a random sign where the operation has one).  Images are float 0-255 here.

def _gray(x):  # as uint8, as torchvision's rgb_to_grayscale gives it
    return (0.2989 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2]).unsqueeze(1).floor()


def _blend(x, other, factor):  # torchvision's _blend: factor 0 gives `other`, 1 the image
    return (factor * x + (1 - factor) * other).clamp(0, 255).floor()


def _sharpness_reference(x):  # PIL's SMOOTH filter inside, the border left as it is
    kernel = torch.ones(3, 3, device=x.device)
    kernel[1, 1] = 5.0
    smooth = F.conv2d(x, (kernel / 13).expand(x.shape[1], 1, 3, 3), groups=x.shape[1])
    out = x.clone()
    out[..., 1:-1, 1:-1] = smooth.round()
    return out


def _equalize(x):
    """Histogram equalisation of each image's each channel, as torchvision's equalize."""
    b, c, h, w = x.shape
    v = x.reshape(b * c, h * w).long()
    hist = torch.zeros(b * c, 256, device=x.device).scatter_add_(1, v, torch.ones_like(v, dtype=torch.float))
    last = hist.gather(1, (hist > 0).long().cumsum(1).argmax(1, keepdim=True))  # top bin's count
    step = ((hist.sum(1, keepdim=True) - last) / 255).floor()
    lut = ((hist.cumsum(1) + (step / 2).floor()) / step.clamp(min=1)).floor()
    lut = F.pad(lut, (1, 0))[:, :-1].clamp(0, 255)
    lut = torch.where(step > 0, lut, torch.arange(256., device=x.device))  # flat: unchanged
    return lut.gather(1, v).view(b, c, h, w)


def _affine(x, m, sign, kind):
    """Shear (up to 0.99), translate (up to 32 px) or rotate (up to 135 degrees) about the
    centre, nearest pixel, zeros outside, as torchvision's affine does."""
    b, _, h, w = x.shape
    theta = torch.eye(2, 3, device=x.device).repeat(b, 1, 1)
    s = sign * m
    if kind == "shear_x":
        theta[:, 0, 1] = s * 0.99
    elif kind == "shear_y":
        theta[:, 1, 0] = s * 0.99
    elif kind == "translate_x":  # whole pixels
        theta[:, 0, 2] = sign * (m * 32).floor() * 2 / w
    elif kind == "translate_y":
        theta[:, 1, 2] = sign * (m * 32).floor() * 2 / h
    else:
        angle = s * math.radians(135)
        theta[:, :, :2] = torch.stack([torch.stack([angle.cos(), -angle.sin()], 1),
                                       torch.stack([angle.sin(), angle.cos()], 1)], 1)
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode="nearest", padding_mode="zeros", align_corners=False)


def _color(x, m, sign, kind):
    f = (1 + sign * m * 0.99).view(-1, 1, 1, 1)
    if kind == "brightness":
        return _blend(x, torch.zeros_like(x), f)
    if kind == "color":
        return _blend(x, _gray(x), f)
    if kind == "contrast":
        return _blend(x, _gray(x).mean((1, 2, 3), keepdim=True), f)
    return _blend(x, _sharpness_reference(x), f)


def _levels(x, m, sign, kind):
    m = m.view(-1, 1, 1, 1)
    if kind == "posterize":  # keep 8 down to 2 bits
        bits = 8 - (m * 30 / 5).round()
        return (x / 2 ** (8 - bits)).floor() * 2 ** (8 - bits)
    if kind == "solarize":  # invert what lies at or above 255 down to 0
        return torch.where(x >= 255 * (1 - m), 255 - x, x)
    if kind == "autocontrast":
        low, high = x.amin((2, 3), keepdim=True), x.amax((2, 3), keepdim=True)
        scale = torch.where(high > low, 255 / (high - low).clamp(min=1), torch.ones_like(low))
        return torch.where(high > low, (x - low) * scale, x).clamp(0, 255).floor()
    return _equalize(x)


OPERATIONS = {"shear_x": _affine, "shear_y": _affine, "translate_x": _affine,
              "translate_y": _affine, "rotate": _affine, "brightness": _color, "color": _color,
              "contrast": _color, "sharpness": _color, "posterize": _levels,
              "solarize": _levels, "autocontrast": _levels, "equalize": _levels}


def trivial_augment(x, gen):
    """TrivialAugmentWide of a uint8 batch, per image; the identity is the 14th choice."""
    b, dev = x.shape[0], x.device
    choice = torch.randint(0, len(OPERATIONS) + 1, (b,), device=dev, generator=gen)
    m = torch.randint(0, 31, (b,), device=dev, generator=gen) / 30
    sign = torch.where(torch.rand(b, device=dev, generator=gen) < 0.5, -1.0, 1.0)
    order = choice.argsort()
    counts = torch.bincount(choice, minlength=len(OPERATIONS) + 1).tolist()  # one sync
    parts = list(x[order].float().split(counts))
    for k, (kind, apply) in enumerate(OPERATIONS.items()):
        if counts[k]:
            chosen = order[sum(counts[:k]):sum(counts[:k + 1])]
            parts[k] = apply(parts[k], m[chosen], sign[chosen], kind)
    out = torch.empty_like(x)
    out[order] = torch.cat(parts).round().clamp(0, 255).to(x.dtype)
    return out


# ------------------------------------------------------------------- erasing and mixing
def random_erase(x, p, gen, fill):
    """torchvision's RandomErasing(p) after normalisation, per image, on a uint8 batch: with
    probability `p`, a rectangle of 2-33 % of the image, of aspect 0.3-3.3 (cut to the image
    where it overflows, not drawn again), set to `fill` (the mean colour: 0 once normalised)."""
    b, _, h, w = x.shape
    dev = x.device
    u = torch.rand(5, b, device=dev, generator=gen)
    area = h * w * (0.02 + 0.31 * u[0])
    aspect = torch.exp(math.log(0.3) + (math.log(3.3) - math.log(0.3)) * u[1])
    eh = (area * aspect).sqrt().round().clamp(max=h)
    ew = (area / aspect).sqrt().round().clamp(max=w)
    top = ((h - eh + 1) * u[2]).floor().view(b, 1, 1)
    left = ((w - ew + 1) * u[3]).floor().view(b, 1, 1)
    rows = torch.arange(h, device=dev).view(1, h, 1)
    cols = torch.arange(w, device=dev).view(1, 1, w)
    inside = (rows >= top) & (rows < top + eh.view(b, 1, 1)) & \
             (cols >= left) & (cols < left + ew.view(b, 1, 1)) & (u[4] < p).view(b, 1, 1)
    return torch.where(inside.unsqueeze(1), fill.view(1, -1, 1, 1).to(x.dtype), x)


def mixing(mixup_alpha, cutmix_alpha, num_classes):
    """torchvision's MixUp and CutMix of a batch of (images, labels) into (images, class
    probabilities): one of them per batch where both are on; None where neither is."""
    from torchvision.transforms import v2
    chosen = [mix(alpha=alpha, num_classes=num_classes)
              for mix, alpha in ((v2.MixUp, mixup_alpha), (v2.CutMix, cutmix_alpha)) if alpha]
    return v2.RandomChoice(chosen) if chosen else None
