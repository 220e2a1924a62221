"""ImageNet weights for torchvision's ResNets, from a file or torchvision's weights API.

Compute nodes usually have no network, so the handout copies the weights file next to the
code; `--weights PATH` reads such a file.  Without it, torchvision's weights API downloads
into the torch hub cache (``$TORCH_HOME/hub/checkpoints``) where a network is available.
"""
import os
import pickle
import warnings

import torch

from .errors import UserError

NAMES = {"resnet18": "ResNet-18", "resnet50": "ResNet-50"}


def hub_checkpoint_dir():
    return os.path.join(torch.hub.get_dir(), "checkpoints")


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
    try:
        # weights_only: a file someone put in the hub cache must not run code (torch.hub's
        # default is False; check_hash only applies to a fresh download).
        with warnings.catch_warnings():  # torch's notes on odd files would break the one line
            warnings.simplefilter("ignore")
            return weights.get_state_dict(progress=False, check_hash=True, weights_only=True)
    except pickle.UnpicklingError:
        raise UserError(f"{os.path.join(hub_checkpoint_dir(), weights_file(arch))}: refused: "
                        "not a plain state_dict (it could run code); delete it and copy "
                        f"{weights_file(arch)} from {weights.url} there") from None
    except (OSError, RuntimeError) as exc:  # URLError is an OSError
        raise UserError(
            f"cannot get the ImageNet {NAMES[arch]} weights ({exc.__class__.__name__}: {exc}); "
            f"offline? copy {weights_file(arch)} (from {weights.url}) into {hub_checkpoint_dir()} "
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
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
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
        detail = (missing and f"missing {missing[0]}") or (unexpected and f"unexpected {unexpected[0]}") \
            or f"shape of {wrong[0]} is {tuple(backbone[wrong[0]].shape)}, not {tuple(own[wrong[0]].shape)}"
        raise UserError(f"{source}: not a torchvision {NAMES[arch]} state_dict ({detail}, "
                        f"{len(missing)} missing, {len(unexpected)} unexpected, {len(wrong)} mis-shaped)")
    model.load_state_dict(backbone, strict=False)
