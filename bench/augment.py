"""The regularisers bench/recipes.py tries beside torchvision's TrivialAugmentWide, done as the
scripts' crop and flip are: on the training device, each image drawn its own way, in a few
tensor operations for the whole batch, not a Python call per image (torchvision's per-image
transforms on 128 CPU images cost a third of a training step).  Every draw comes from the
batch's generator, so a batch is augmented alike whether or not its epoch was interrupted."""
import math

import torch
import torch.nn.functional as F


def rotate(x, degrees, gen):
    """Each image of a uint8 batch rotated about its centre by its own angle, uniform within
    `degrees` either way: nearest pixel, zeros outside, as torchvision's RandomRotation."""
    b = x.shape[0]
    angle = (torch.rand(b, device=x.device, generator=gen) * 2 - 1) * math.radians(degrees)
    theta = torch.zeros(b, 2, 3, device=x.device)
    theta[:, 0, 0], theta[:, 0, 1] = angle.cos(), -angle.sin()
    theta[:, 1, 0], theta[:, 1, 1] = angle.sin(), angle.cos()
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x.float(), grid, mode="nearest", padding_mode="zeros",
                         align_corners=False).to(x.dtype)


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
