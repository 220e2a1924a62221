"""Models: the HW4 ResNet of Figures 1 and 2, and torchvision's ResNet-18 for fine-tuning.

Two choices the handout leaves open are named arguments of `HW4ResNet`:

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
import torch
from torch import nn

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

    def __init__(self, num_classes=100, dropout=0.1, post_add_relu=True, zero_init_residual=True,
                 stages=HW4_STAGES):
        super().__init__()
        width = stages[0][0]
        self.conv1 = conv3x3(3, width, stride=1)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.dropout = nn.Dropout(dropout)
        layers = []
        in_channels = width
        for out_channels, blocks, stride in stages:
            stage = [BasicBlock(in_channels, out_channels, stride, post_add_relu)]
            stage += [BasicBlock(out_channels, out_channels, 1, post_add_relu)
                      for _ in range(blocks - 1)]
            layers.append(nn.Sequential(*stage))
            in_channels = out_channels
        self.conv2_x, self.conv3_x, self.conv4_x, self.conv5_x = layers
        self.pool = nn.AdaptiveMaxPool2d(1)
        self.fc = nn.Linear(in_channels, num_classes)
        self._init_weights(zero_init_residual)

    def _init_weights(self, zero_init_residual):
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        if zero_init_residual:
            for m in self.modules():
                if isinstance(m, BasicBlock):
                    nn.init.zeros_(m.bn2.weight)

    def forward(self, x):
        x = self.dropout(self.relu(self.bn1(self.conv1(x))))
        x = self.conv5_x(self.conv4_x(self.conv3_x(self.conv2_x(x))))
        return self.fc(torch.flatten(self.pool(x), 1))


ARCHS = ("hw4", "resnet18", "resnet50")


def build_model(arch, num_classes, dropout=0.1):
    """`hw4`: Figures 1 and 2.  `resnet18`, `resnet50`: torchvision's (its ResNet-50 is v1.5,
    the stride on the 3x3 convolution of each bottleneck, as in seed 001's workload)."""
    if arch == "hw4":
        return HW4ResNet(num_classes, dropout=dropout)
    import torchvision
    return getattr(torchvision.models, arch)(num_classes=num_classes)


def count_parameters(model):
    return sum(p.numel() for p in model.parameters())
