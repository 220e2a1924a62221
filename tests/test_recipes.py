"""bench/recipes.py, the recipes side by side, and the regularisers it tries (bench/augment.py):
rotation and random erasing drawn per image on the device as torchvision draws them per image,
MixUp and CutMix."""
import csv
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from torchvision.transforms.v2 import functional as TF

from helpers import ROOT, child_env

sys.path.insert(0, os.path.join(ROOT, "bench"))  # bench/ is no package; its names stay out
import augment  # noqa: E402
sys.path.remove(os.path.join(ROOT, "bench"))


def photos(n=6, size=32):
    x = torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8,
                      generator=torch.Generator().manual_seed(0))
    x[n - 1] = x[n - 1] // 4 + 100  # a dull one, for the contrast operations
    return x


def test_rotation_is_torchvisions_per_image_within_the_range_either_way():
    """P2's rotation: each image its own angle, drawn within 15 degrees either way, and the
    image torchvision's rotate gives at some angle of that range, zeros outside (but for under
    1 % of pixels, which float rounding sends to a neighbouring pixel)."""
    x = photos(1).expand(400, -1, -1, -1).contiguous()
    out = augment.rotate(x, 15.0, torch.Generator().manual_seed(0))
    angles = torch.arange(-15.0, 15.001, 0.02)
    candidates = torch.stack([TF.rotate(x[0], a.item()) for a in angles])
    found = []
    for img in out[:40]:
        differ = (candidates != img).flatten(1).float().mean(1)
        assert differ.min() < 0.01  # some angle within the range gives this image
        found.append(angles[differ.argmin()].item())
    assert min(found) < -5 and max(found) > 5  # both ways, not one
    assert len({img.numpy().tobytes() for img in out}) > 100


def test_random_erasing_blanks_a_rectangle_of_about_p_of_the_images():
    x = torch.full((2000, 3, 16, 16), 200, dtype=torch.uint8)
    fill = torch.tensor([7, 7, 7])  # the mean colour
    out = augment.random_erase(x, 0.25, torch.Generator().manual_seed(0), fill)
    blank = out == 7
    erased = blank.flatten(1).any(1)
    assert 0.22 < erased.float().mean() < 0.28
    assert torch.equal(blank.all(1), blank.any(1))  # every channel alike
    for img in blank[erased][:50, 0]:  # a rectangle: its rows are one interval of columns
        rows, cols = img.any(1).nonzero().flatten(), img.any(0).nonzero().flatten()
        assert img[rows.min():rows.max() + 1, cols.min():cols.max() + 1].all()
        assert img.sum() == len(rows) * len(cols)


def test_mixup_mixes_the_images_and_their_labels_alike():
    """MixUp: each image a blend of itself and its neighbour in the batch, its target the same
    blend of their classes (labels left one-hot would teach the blend is the first class)."""
    images = torch.arange(4.0).view(4, 1, 1, 1).expand(4, 3, 2, 2).contiguous()
    mixed, target = augment.mixing(0.4, 0.0, 5)(images, torch.tensor([0, 1, 2, 3]))
    lam = target[1, 1].item()
    assert 0 < lam < 1 and torch.allclose(target.sum(1), torch.ones(4))
    assert torch.allclose(target[1, 0], torch.tensor(1 - lam))  # its neighbour's class
    assert torch.allclose(mixed[1], torch.full((3, 2, 2), lam * 1 + (1 - lam) * 0))


@pytest.mark.parametrize("recipe, extra, lr", [
    ("P2", [], 0.01), ("ours", ["--random-erase", "0.5", "--mixup-alpha", "0.2",
                                "--cutmix-alpha", "1.0"], None)])
def test_recipes_train_the_script_with_the_recipes_optimizer_and_regularisers(
        tmp_path, recipe, extra, lr):
    """Two epochs of the script under a peer's recipe (P2: SGD at a constant 0.01 until its
    epoch 20) and under ours with every regulariser: each epoch's row and its line, with the
    flip and EMA accuracies at the last."""
    out = tmp_path / recipe
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "recipes.py"), "--recipe", recipe, *extra,
         "--extra-every", "3", "--", "--dummy", "--epochs", "2", "--train-limit", "64",
         "--test-limit", "32", "--batch-size", "16", "--out", str(out)],
        capture_output=True, text=True, env=child_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr
    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2
    if lr is not None:
        assert [float(r["lr"]) for r in rows] == [lr, lr]
    with open(out / "extra.jsonl") as f:
        lines = [json.loads(line) for line in f]
    assert [line["epoch"] for line in lines] == [1, 2]
    assert "flip" not in lines[0]  # not an epoch of --extra-every 3, nor the last
    assert {"flip", "ema 0.999", "ema 0.9998 flip"} <= set(lines[1])
    assert [line["test_acc"] for line in lines] == [float(r["test_acc"]) for r in rows]


def test_mixed_batches_carry_blended_targets_drawn_after_the_batch_is_seeded():
    """bench/recipes.py's MixUp/CutMix batches: class probabilities, blended (not one-hot),
    and the same when the epoch is resumed at batch 2."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import recipes
    sys.path.remove(os.path.join(ROOT, "bench"))
    from common.data import ImageSet
    from common.loader import DeviceLoader
    data = ImageSet(photos(16, 8), torch.arange(16) % 4, ["a", "b", "c", "d"])
    raw = dict(mean=(0.0, 0.0, 0.0), std=(1 / 255, 1 / 255, 1 / 255))
    batches = recipes.mixed(augment.mixing(0.5, 1.0, 4))
    whole = list(batches(DeviceLoader(data, 4, "cpu", train=True, **raw), 1))
    assert all(y.shape == (4, 4) and torch.allclose(y.sum(1), torch.ones(4)) for _, y in whole)
    assert any(y.max() < 0.99 for _, y in whole)
    resumed = list(batches(DeviceLoader(data, 4, "cpu", train=True, **raw), 1, start=2))
    for (x, y), (x_again, y_again) in zip(whole[2:], resumed):
        assert torch.equal(x, x_again) and torch.equal(y, y_again)


def test_the_emas_follow_the_weights_and_resume_from_their_file(tmp_path):
    """bench/recipes.py's EMAs of the weights: each optimizer step moves each (1 - decay) of the
    way to the weights (the first step copies them), and a resumed run's EMAs go on from where
    --out/ema.pt left them, not from the weights of the moment."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import recipes
    sys.path.remove(os.path.join(ROOT, "bench"))
    model = torch.nn.Linear(3, 2, bias=False)

    def step_to(value, found):
        with torch.no_grad():
            model.weight.fill_(value)
        recipes.follow(found)
        return {d: ema.module.weight.mean().item() for d, ema in found["emas"].items()}
    found = {"model": model, "ema_file": str(tmp_path / "ema.pt")}
    assert step_to(1.0, found) == {d: 1.0 for d in recipes.EMA_DECAYS}
    after = step_to(3.0, found)
    for d in recipes.EMA_DECAYS:
        assert after[d] == pytest.approx(d * 1.0 + (1 - d) * 3.0)
    torch.save({str(d): e.state_dict() for d, e in found["emas"].items()}, tmp_path / "ema.pt")
    resumed = step_to(3.0, {"model": model, "ema_file": str(tmp_path / "ema.pt")})
    for d in recipes.EMA_DECAYS:
        assert resumed[d] == pytest.approx(d * after[d] + (1 - d) * 3.0)
