"""Models: the HW4 ResNet of Figures 1 and 2, and torchvision's ResNets with their ImageNet
weights for fine-tuning.

Three choices the handout leaves open; the first two are named arguments of `HW4ResNet`:

* ``post_add_relu`` -- Figure 2 draws no ReLU after the addition; He et al. (2016) and the
  slides' ``BasicBlock`` code apply one.  Default ``True`` (He et al.); ``False`` is Figure 2
  to the letter.
* ``zero_init_residual`` -- the last BN of every block starts with weight 0, so that each
  block starts as the identity (Goyal et al., 2017; torchvision's option of the same name):
  smaller initial logits and a stabler warm-up.  It changes the initial values only.
* the max pool -- a global max pool over whatever the last stage produces: 4x4 -> 1x1 for
  32x32 inputs (CIFAR-100), 8x8 -> 1x1 for 64x64 inputs (TinyImageNet).  The fully connected
  layer therefore always sees 256 features, and one class serves both input sizes.
"""
import os
import pickle
import warnings

import torch
from torch import nn

from .run import UserError

# Figure 1: (output channels, number of basic blocks, stride of the first block) per stage.
HW4_STAGES = (
    (32, 2, 1),    # conv2_x
    (64, 4, 2),    # conv3_x
    (128, 4, 2),   # conv4_x
    (256, 2, 2),   # conv5_x
)


def conv3x3(in_channels, out_channels, stride=1):
    return nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)


class BasicBlock(nn.Module):
    """Figure 2: conv3x3 -> BN -> ReLU -> conv3x3 -> BN, plus the shortcut.

    Where the shape changes (stride 2 or more channels) the shortcut is a 1x1 convolution
    with the same stride followed by BN (He et al.'s projection shortcut, option B).
    """

    def __init__(self, in_channels, out_channels, stride=1, post_add_relu=True):
        super().__init__()
        self.conv1 = conv3x3(in_channels, out_channels, stride)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(out_channels, out_channels)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )
        self.post_add_relu = post_add_relu

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out = out + self.shortcut(x)
        return self.relu(out) if self.post_add_relu else out


class HW4ResNet(nn.Module):
    """Figure 1: conv1 -> BN -> ReLU -> Dropout -> conv2_x..conv5_x -> max pool -> FC."""

    def __init__(self, num_classes=100, dropout=0.1, post_add_relu=True, zero_init_residual=True):
        super().__init__()
        in_channels = HW4_STAGES[0][0]
        self.conv1 = conv3x3(3, in_channels, stride=1)
        self.bn1 = nn.BatchNorm2d(in_channels)
        self.relu = nn.ReLU(inplace=True)
        self.dropout = nn.Dropout(dropout)
        layers = []
        for out_channels, blocks, stride in HW4_STAGES:
            stage = [BasicBlock(in_channels, out_channels, stride, post_add_relu)]
            stage += [BasicBlock(out_channels, out_channels, 1, post_add_relu)
                      for _ in range(blocks - 1)]
            layers.append(nn.Sequential(*stage))
            in_channels = out_channels
        self.conv2_x, self.conv3_x, self.conv4_x, self.conv5_x = layers
        self.pool = nn.AdaptiveMaxPool2d(1)
        self.fc = nn.Linear(in_channels, num_classes)
        for m in self.modules():  # (BatchNorm starts at weight 1, bias 0: torch's default)
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, BasicBlock) and zero_init_residual:
                nn.init.zeros_(m.bn2.weight)

    def forward(self, x):
        x = self.dropout(self.relu(self.bn1(self.conv1(x))))
        x = self.conv5_x(self.conv4_x(self.conv3_x(self.conv2_x(x))))
        return self.fc(torch.flatten(self.pool(x), 1))


ARCHS = ("hw4", "resnet18", "resnet50")


def build_model(arch, num_classes, dropout=0.1):
    """`hw4`: Figures 1 and 2.  `resnet18`, `resnet50`: torchvision's (its ResNet-50 is v1.5,
    the stride on the 3x3 convolution of each bottleneck)."""
    if arch == "hw4":
        return HW4ResNet(num_classes, dropout=dropout)
    import torchvision
    return getattr(torchvision.models, arch)(num_classes=num_classes)

# ---------------------------------------------------------------------------- ImageNet weights
#
# Compute nodes usually have no network, so the handout copies the weights file next to the
# code; `--weights PATH` reads such a file.  Without it, torchvision's weights API downloads
# into the torch hub cache ($TORCH_HOME/hub/checkpoints) where a network is available.

NAMES = {"resnet18": "ResNet-18", "resnet50": "ResNet-50"}


def imagenet_weights(arch):
    """torchvision's default ImageNet weights enum for `arch` (ResNet-18: resnet18-f37072fd.pth)."""
    import torchvision.models as models
    return {"resnet18": models.ResNet18_Weights, "resnet50": models.ResNet50_Weights}[arch].DEFAULT


def weights_file(arch):
    """The file name torchvision's weights API caches, e.g. resnet18-f37072fd.pth."""
    return os.path.basename(imagenet_weights(arch).url)


def load_imagenet_state_dict(arch, path=None):
    """Return an ImageNet state_dict for `arch`, from `path` or through torchvision."""
    if path is not None:
        return _read_state_dict(path, arch)
    weights = imagenet_weights(arch)
    name = os.path.basename(weights.url)
    cached = os.path.join(torch.hub.get_dir(), "checkpoints", name)  # where torchvision reads it
    try:
        # weights_only: a file someone put in the hub cache must not run code (torch.hub's
        # default is False; check_hash only applies to a fresh download).
        with warnings.catch_warnings():  # torch's notes on odd files would break the one line
            warnings.simplefilter("ignore")
            return weights.get_state_dict(progress=False, check_hash=True, weights_only=True)
    except (OSError, RuntimeError, pickle.UnpicklingError) as exc:  # URLError is an OSError
        why = ("refused: not a plain state_dict (it could run code)" if isinstance(
            exc, pickle.UnpicklingError) else f"unreadable ({exc.__class__.__name__})")
        if os.path.isfile(cached):  # there, but refused or not readable (truncated, say)
            raise UserError(f"{cached}: {why}; delete it and copy {name} from {weights.url} "
                            "there, or pass --weights PATH") from None
        raise UserError(
            f"cannot get the ImageNet {NAMES[arch]} weights ({exc.__class__.__name__}: {exc}); "
            f"offline? copy {name} (from {weights.url}) into {os.path.dirname(cached)} "
            f"or pass --weights PATH") from None


def _read_state_dict(path, arch):
    if not os.path.isfile(path):
        raise UserError(f"--weights {path}: no such file; copy "
                        f"{weights_file(arch)} there or point --weights at it")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch's own message is many lines: name the class only
        raise UserError(f"--weights {path}: not a readable PyTorch state_dict "
                        f"({exc.__class__.__name__}); expected a file written by "
                        f"torch.save(model.state_dict()), such as "
                        f"{weights_file(arch)}") from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise UserError(f"--weights {path}: expected a {NAMES[arch]} state_dict (name -> tensor)")
    return state


def load_backbone(model, state, source, arch):
    """Copy `state` into torchvision ResNet `model`, all but its new `fc` head.

    Every backbone tensor must be present with the right shape: a file of another
    architecture is rejected with one line instead of training from partly random weights.
    """
    own = model.state_dict()
    backbone = {k: v for k, v in state.items() if not k.startswith("fc.")}
    missing = [k for k in own if not k.startswith("fc.") and k not in backbone]
    unexpected = [k for k in backbone if k not in own]
    wrong = [k for k in backbone if k in own and backbone[k].shape != own[k].shape]
    if missing or unexpected or wrong:
        k = (missing or unexpected or wrong)[0]  # the first one found, named
        detail = (f"missing {k}" if missing else f"unexpected {k}" if unexpected else
                  f"shape of {k} is {tuple(backbone[k].shape)}, not {tuple(own[k].shape)}")
        raise UserError(f"{source}: not a torchvision {NAMES[arch]} state_dict ({detail}, "
                        f"{len(missing)} missing, {len(unexpected)} unexpected, "
                        f"{len(wrong)} mis-shaped)")
    model.load_state_dict(backbone, strict=False)
