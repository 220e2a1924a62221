"""The field's classic training bugs, each caught by what a user would notice: an accuracy, a
loss, an order, a count.  `python tests/mutants.py` puts each bug into a copy of the tree and
checks that a test fails; the tests here are the ones that no other file had.

In-process tests drive the real pieces (`training.evaluate`, the mains' `train_one_epoch`, their
optimizer set-up, the loaders) on tiny tensors; the end-to-end ones run the scripts as a user
does, on a few dozen generated images.
"""
import json
import math
from collections import OrderedDict
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import async_sgd_cifar100
import pretrained_cifar100
import resnet_cifar100
import resnet_tinyimagenet
import sync_sgd_cifar100
from common import data, loader, training
from common.checkpoint import State
from common.collectives import Comm
from common.distributed import import_before_init
from common.loader import DeviceLoader
from common.messages import DONE, GRADIENT, Messages
from common.model import HW4ResNet
from common.network import free_port
from common.run import Run
from datagen import make_cifar100, write_cifar100_pickles
from helpers import ROOT, child_env

TIMEOUT = 240
MPIRUN = os.path.join(os.path.dirname(sys.executable), "mpirun")
if not os.path.exists(MPIRUN):
    MPIRUN = "mpirun"
RAW = dict(mean=(0.0, 0.0, 0.0), std=(1 / 255, 1 / 255, 1 / 255))  # pixels pass unchanged


def cpu_process(tmp_path, script="test", rank=0, world_size=1):
    return Run(script, str(tmp_path), torch.device("cpu"), False, rank, world_size)


def image_set(n, classes, size=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=g)
    labels = torch.arange(n) % classes
    return data.ImageSet(images, labels, [str(c) for c in range(classes)])


# ------------------------------------------------------------------------- evaluation

def bn_dropout_net(classes=10):
    """A small network whose output depends on train/eval mode twice over: BatchNorm with
    running statistics far from any batch's, and heavy dropout."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                        nn.Dropout(0.5), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                        nn.Linear(8, classes))
    bn = net[1]
    bn.running_mean.uniform_(-2, 2)
    bn.running_var.uniform_(0.5, 3)
    return net


def labelled_for_known_accuracy(net, images, correct):
    """Labels such that the first `correct` samples are classified right in eval mode, the rest
    wrong; with the plain cross-entropy of those labels (what evaluate should report)."""
    net.eval()
    with torch.no_grad():
        output = net(images)
    net.train()  # as the training loop leaves it
    predicted = output.argmax(1)
    labels = torch.where(torch.arange(len(images)) < correct, predicted,
                         (predicted + 1) % output.shape[1])
    return labels, F.cross_entropy(output, labels).item()


def test_evaluation_is_the_same_at_every_test_batch_size_and_leaves_the_model_alone(tmp_path):
    """Test loss and accuracy are those of the model in eval mode (running BatchNorm statistics,
    no dropout), counted per sample (an uneven last batch weighs by its size), with plain
    cross-entropy; evaluating changes no BatchNorm buffer."""
    net = bn_dropout_net()
    images = torch.randint(0, 256, (25, 3, 8, 8), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(1))
    normalised = images.float() / 255
    labels, plain_loss = labelled_for_known_accuracy(net, normalised, correct=10)
    test_set = data.ImageSet(images, labels, [str(c) for c in range(10)])
    buffers = {k: v.clone() for k, v in net.state_dict().items() if "running" in k}
    proc = cpu_process(tmp_path)
    for batch_size in (25, 7, 4):  # one batch; 7+7+7+4; 6 x 4 + 1
        test = DeviceLoader(test_set, batch_size, "cpu", train=False, mean=(0, 0, 0),
                            std=(1, 1, 1))
        loss, accuracy = training.evaluate(net, test, proc)
        assert accuracy == pytest.approx(40.0), (batch_size, accuracy)  # 10 of 25
        assert loss == pytest.approx(plain_loss, rel=1e-5), (batch_size, loss, plain_loss)
        for name, value in net.state_dict().items():
            if name in buffers:
                assert torch.equal(value, buffers[name]), (batch_size, name)


def test_evaluation_builds_no_autograd_graph(tmp_path):
    """No activation is kept for a backward pass during evaluation (memory a test pass would
    otherwise hold): no output the model produces has a grad_fn."""
    net = bn_dropout_net()
    seen = []
    net.register_forward_hook(lambda module, args, output: seen.append(output.grad_fn))
    test = DeviceLoader(image_set(12, 10), 5, "cpu", train=False, **RAW)
    training.evaluate(net, test, cpu_process(tmp_path))
    assert len(seen) == 3 and all(grad_fn is None for grad_fn in seen), seen


# ------------------------------------------------------------- the mains' training loops

class Recorder(nn.Module):
    """A linear classifier that keeps every batch it is given."""

    def __init__(self, features, classes):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(features, classes)
        self.inputs = []

    def forward(self, x):
        self.inputs.append(x.detach().clone())
        return self.fc(x.flatten(1))


class RecordingLoss(nn.CrossEntropyLoss):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.labels = []

    def forward(self, output, labels):
        self.labels.append(labels.clone())
        return super().forward(output, labels)


# each main's own loop, the sync one in a world of 1 (nothing to average)
LOOPS = {
    "resnet_cifar100": (resnet_cifar100, resnet_cifar100.train_one_epoch),
    "resnet_tinyimagenet": (resnet_tinyimagenet, resnet_tinyimagenet.train_one_epoch),
    "pretrained_cifar100": (pretrained_cifar100, pretrained_cifar100.train_one_epoch),
    "sync_sgd_cifar100": (sync_sgd_cifar100, lambda *a: sync_sgd_cifar100.train_one_epoch(
        *a, Comm(0, 1))),
}


def run_epochs(name, tmp_path, epochs, *flags, n=12, batch=4):
    """Train a Recorder with `name`'s train_one_epoch as its main does (optimizer from
    training.param_groups, the warm-up + cosine schedule); return the model, its initial
    parameters, the criterion and the parsed arguments."""
    module, train_one_epoch = LOOPS[name]
    args = module.parse_args(["--epochs", str(epochs), "--batch-size", str(batch), *flags])
    proc = cpu_process(tmp_path, name)
    train = DeviceLoader(image_set(n, n), batch, "cpu", train=True, seed=args.seed, **RAW)
    model = Recorder(3 * 8 * 8, n)
    initial = [p.detach().clone() for p in model.parameters()]
    criterion = RecordingLoss(label_smoothing=args.label_smoothing)
    optimizer = torch.optim.SGD(training.param_groups(model, args.weight_decay), lr=args.lr,
                                momentum=args.momentum, nesterov=args.momentum > 0, fused=True)
    scheduler = training.warmup_cosine(optimizer, args, len(train))
    for epoch in range(epochs):
        train_one_epoch(model, criterion, optimizer, scheduler, train, epoch, proc)
    return model, initial, criterion, args


def test_each_epoch_visits_every_sample_once_in_a_new_order(tmp_path):
    """resnet_cifar100's loop over 3 epochs of 12 samples (each labelled by its index): every
    epoch sees each sample once, and no two epochs in the same order."""
    _, _, criterion, _ = run_epochs("resnet_cifar100", tmp_path, 3)
    seen = torch.cat(criterion.labels).view(3, 12).tolist()
    assert all(sorted(order) == list(range(12)) for order in seen), seen
    assert seen[0] != seen[1] and seen[1] != seen[2] and seen[0] != seen[2], seen


@pytest.mark.parametrize("name", sorted(LOOPS))
def test_every_sgd_step_uses_its_own_batch_and_the_per_step_schedule(name, tmp_path):
    """Replayed by hand, step by step, from the batches the model saw: each update is
    lr_k x the gradient of batch k alone (gradients do not pile up across steps), and lr_k
    follows the schedule every step -- 1 epoch of linear warm-up then a cosine to 0, here over
    2 epochs of 3 steps: factors 1/3, 2/3, 1, 1, 3/4, 1/4."""
    model, initial, criterion, args = run_epochs(name, tmp_path, 2, "--lr", "0.5",
                                                 "--momentum", "0", "--weight-decay", "0",
                                                 "--warmup-epochs", "1")
    factors = [1 / 3, 2 / 3, 1.0, 1.0, 0.75, 0.25]
    assert len(model.inputs) == len(factors)
    weight, bias = initial
    for x, y, factor in zip(model.inputs, criterion.labels, factors):
        weight.requires_grad_(True)
        bias.requires_grad_(True)
        loss = F.cross_entropy(F.linear(x.flatten(1), weight, bias), y,
                               label_smoothing=args.label_smoothing)
        grad_w, grad_b = torch.autograd.grad(loss, (weight, bias))
        weight = (weight - 0.5 * factor * grad_w).detach()
        bias = (bias - 0.5 * factor * grad_b).detach()
    torch.testing.assert_close(model.fc.weight.detach(), weight, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.fc.bias.detach(), bias, rtol=1e-5, atol=1e-6)


def test_weight_decay_shrinks_conv_and_linear_weights_only(tmp_path):
    """The mains' optimizer (the recipe: SGD, Nesterov momentum 0.9, weight decay 5e-4 through
    training.param_groups): one step on zero gradients shrinks every convolution and linear
    weight by lr x wd x (1 + momentum), and leaves BatchNorm weights and all biases as they
    were."""
    recipe = resnet_cifar100.RECIPE
    lr, momentum, wd = recipe["lr"], recipe["momentum"], recipe["weight_decay"]
    model = HW4ResNet(10)
    for m in model.modules():  # no zero-initialised BN weights: decay would not show on them
        if isinstance(m, nn.BatchNorm2d):
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.uniform_(m.bias, -0.5, 0.5)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD(training.param_groups(model, wd), lr=lr, momentum=momentum,
                                nesterov=True, fused=True)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    shrink = 1 - lr * wd * (1 + momentum)
    decayed = kept = 0
    for prefix, m in model.named_modules():
        for name, p in m.named_parameters(recurse=False):
            full = f"{prefix}.{name}" if prefix else name
            if isinstance(m, (nn.Conv2d, nn.Linear)) and name == "weight":
                # tight: the decay is a relative change of 1e-4, a default tolerance's size
                torch.testing.assert_close(p.detach(), before[full] * shrink, rtol=1e-6,
                                           atol=1e-9, msg=full)
                decayed += 1
            else:  # BatchNorm weights and biases, the linear layer's bias
                assert torch.equal(p.detach(), before[full]), full
                kept += 1
    assert decayed > 20 and kept > 20


# ------------------------------------------------------------------------- normalisation

def constant_colour_set(n, size=32):
    """Images of one flat colour each (a crop's shift or a flip keeps the centre pixel)."""
    g = torch.Generator().manual_seed(5)
    colours = torch.randint(0, 256, (n, 3, 1, 1), dtype=torch.uint8, generator=g)
    return data.ImageSet(colours.expand(n, 3, size, size).contiguous(), torch.arange(n),
                         [str(c) for c in range(n)])  # labelled by their index


CIFAR_STATS = ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762))
IMAGENET_STATS = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))


@pytest.mark.parametrize("pretrained, stats", [(False, CIFAR_STATS), (True, IMAGENET_STATS)],
                         ids=["cifar100", "imagenet-weights"])
def test_training_and_test_batches_are_normalised_alike(tmp_path, pretrained, stats):
    """make_loader for CIFAR-100: training and test images are both normalised with CIFAR-100's
    mean and std -- ImageNet's for ImageNet weights."""
    # (no TrivialAugment: it changes the colours, which this test compares)
    args = resnet_cifar100.parse_args(["--batch-size", "8", "--auto-augment", "none"])
    images = constant_colour_set(16)
    train, test = (loader.make_loader(images, args, cpu_process(tmp_path), train=train,
                                      pretrained=pretrained) for train in (True, False))
    mean, std = (torch.tensor(s).view(1, 3) for s in stats)
    for which in (train, test):
        which.set_epoch(0)
        for x, y in which:
            centre = x[:, :, 16, 16]
            expected = (images.images[y, :, 0, 0].float() / 255 - mean) / std
            torch.testing.assert_close(centre, expected, rtol=1e-4, atol=1e-4)


def with_forward_hook(hook):
    """A `python -c` program that runs the script named by its first argument with `hook`'s
    `hook(module, args)` as a forward pre-hook on every module, and its `save()` at exit."""
    return ("import atexit, json, os, runpy, sys, torch\n" + hook +
            "atexit.register(save)\n"
            "torch.nn.modules.module.register_module_forward_pre_hook(hook)\n"
            "sys.argv = sys.argv[1:]\n"
            "runpy.run_path(sys.argv[0], run_name='__main__')\n")


WITH_INPUT_HOOK = with_forward_hook(r"""
seen = {"sum": [0.0, 0.0, 0.0], "pixels": 0}
def hook(module, args):  # every test batch the torchvision ResNet receives
    if type(module).__name__ == "ResNet" and not module.training:
        x = args[0].detach().double()
        seen["sum"] = [a + b for a, b in zip(seen["sum"], x.sum(dim=(0, 2, 3)).tolist())]
        seen["pixels"] += x.numel() // 3
def save():
    with open(os.environ["INPUTS_OUT"], "w") as f:
        json.dump(seen, f)
""")


def test_pretrained_script_feeds_imagenet_normalised_images(tmp_path, resnet18_weights):
    """pretrained_cifar100.py, as a user runs it: the test images its ResNet-18 receives have the
    per-channel mean of the data normalised with ImageNet's statistics (which the pretrained
    filters expect), not CIFAR-100's."""
    make_cifar100(tmp_path / "data", n_train=16, n_test=8, num_classes=100, seed=2)
    record = tmp_path / "inputs.json"
    result = subprocess.run(
        [sys.executable, "-c", WITH_INPUT_HOOK, "pretrained_cifar100.py",
         "--data-dir", str(tmp_path / "data"), "--out", str(tmp_path / "out"),
         "--weights", str(resnet18_weights), "--epochs", "1", "--batch-size", "8",
         "--image-size", "32", "--device", "cpu", "--no-amp"],
        cwd=ROOT, env=child_env(INPUTS_OUT=str(record)), capture_output=True, text=True,
        timeout=TIMEOUT)
    assert result.returncode == 0, result.stdout + result.stderr
    seen = json.loads(record.read_text())
    assert seen["pixels"] == 8 * 32 * 32
    test_images = data.read_cifar100(str(tmp_path / "data"), False).images.double()
    pixel_mean = test_images.mean(dim=(0, 2, 3)) / 255
    mean, std = (torch.tensor(s, dtype=torch.float64) for s in IMAGENET_STATS)
    expected = ((pixel_mean - mean) / std).tolist()
    got = [s / seen["pixels"] for s in seen["sum"]]
    assert got == pytest.approx(expected, abs=1e-4), (got, expected)


# ------------------------------------------------------------------ sync SGD end to end

def last_value_after(log, prefix):
    line = [ln for ln in log.splitlines() if ln.startswith(prefix)][-1]
    return float(line[len(prefix):].split()[0].rstrip("%"))


@pytest.mark.parametrize("world", [2, 3])
def test_sync_sgd_logs_the_accuracy_of_the_model_it_saves(cifar_dir, tmp_path, world):
    """Sync SGD on 2 and 3 ranks: the final test loss and accuracy it logs are those a
    one-process --evaluate of its checkpoint gives (the ranks hold one model: the same start,
    the same BatchNorm statistics, and each test sample counted once -- 31 of them, which do
    not split evenly), and an epoch takes as many steps as one process with the global batch
    would (each rank trains on its own shard only)."""
    out = tmp_path / "out"
    flags = ["--data-dir", str(cifar_dir), "--out", str(out), "--train-limit", "64",
             "--test-limit", "31", "--batch-size", "8", "--epochs", "2", "--device", "cpu",
             "--no-amp"]  # small batches per rank: BatchNorm statistics differ between ranks
    trained = subprocess.run([MPIRUN, "-np", str(world), sys.executable,
                              "sync_sgd_cifar100.py", *flags], cwd=ROOT, env=child_env(),
                             capture_output=True, text=True, timeout=TIMEOUT)
    assert trained.returncode == 0, trained.stdout + trained.stderr
    checked = subprocess.run([sys.executable, "sync_sgd_cifar100.py", *flags, "--evaluate"],
                             cwd=ROOT, env=child_env(), capture_output=True, text=True,
                             timeout=TIMEOUT)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    with open(out / "metrics.csv") as f:
        last = f.read().splitlines()[-1].split(",")
    logged_loss, logged_acc = float(last[3]), float(last[4])
    loss = last_value_after(checked.stdout, "checkpoint after epoch 2: test loss ")
    accuracy = last_value_after(checked.stdout, "final test accuracy: ")
    assert abs(logged_loss - loss) <= 1.5e-4, (logged_loss, loss)
    assert abs(logged_acc - accuracy) <= 0.006, (logged_acc, accuracy)
    steps = torch.load(out / "checkpoint.pt", weights_only=True)["scheduler"]["last_epoch"]
    per_rank_batch = 8 // world
    assert steps == 2 * math.ceil(64 / (per_rank_batch * world)), steps


# --------------------------------------------------------------------- an async worker

def _async_worker_and_server(rank, port, record):
    """Rank 1 runs async_sgd_cifar100.worker for 2 epochs on 16 samples labelled 0..15; rank 0
    stands in for the parameter server: it keeps every gradient message and always replies
    with all-zero parameters."""
    torch.set_num_threads(1)
    import_before_init()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    args = async_sgd_cifar100.parse_args(["--epochs", "2", "--batch-size", "4"])
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(flatten=nn.Flatten(), fc=nn.Linear(3 * 8 * 8, 16)))
    layout = Messages(model, 4)  # with room for the head's inputs
    if rank == 1:
        run = Run("async_sgd_cifar100", ".", torch.device("cpu"), False, 1, 2)
        train = loader.make_loader(image_set(16, 16), args, run, train=True, batch_size=4)
        async_sgd_cifar100.worker(model, train, args, run, 0)
    else:
        messages, message = [], torch.zeros(layout.size)
        reply = torch.zeros(layout.reply_size)  # CONTINUE, then parameters of all zeros
        while True:
            worker = dist.recv(message)
            if message[0].item() == DONE:
                break
            messages.append(message.clone())
            dist.send(reply, dst=worker)
        torch.save(torch.stack(messages), record)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def async_messages(tmp_path_factory):
    record = str(tmp_path_factory.mktemp("async_worker") / "messages.pt")
    mp.start_processes(_async_worker_and_server, args=(free_port(), record), nprocs=2,
                       start_method="spawn")
    return torch.load(record)


def batch_labels(message, smoothing=0.1, classes=16):
    """The labels of the batch a gradient came from, read off the gradient of the bias at zero
    parameters: d loss / d bias_c = (1 - smoothing) (1/C - count_c / n)."""
    n = message[1].item()
    bias_grad = message[4 + 16 * 3 * 8 * 8:4 + 16 * 3 * 8 * 8 + classes].double()
    counts = n * (1 / classes - bias_grad / (1 - smoothing))
    assert torch.allclose(counts, counts.round(), atol=1e-3), counts
    return [c for c, k in enumerate(counts.round().long().tolist()) for _ in range(k)]


def test_async_worker_computes_on_the_parameters_the_server_sends(async_messages):
    """After the first gradient (at the worker's initial weights), every gradient is computed on
    the server's reply -- all zeros, where every sample's loss is exactly ln(16)."""
    losses = async_messages[:, 3] / async_messages[:, 1]
    assert len(async_messages) == 8  # 2 epochs x 16 samples / batch 4
    assert abs(losses[0].item() - math.log(16)) > 1e-2  # the initial weights are not zero
    assert torch.allclose(losses[1:], torch.full_like(losses[1:], math.log(16)), atol=1e-5), \
        losses


def test_async_worker_sends_the_heads_inputs_with_its_gradient(async_messages):
    """After the gradient, each message carries the batch's features as the head (fc) saw them -- here the flattened, normalised images -- and the batch's labels, which are
    the labels the gradient came from."""
    head = async_messages[:, 4 + 16 * 3 * 8 * 8 + 16:]
    features, labels = head[:, :4 * 192].reshape(-1, 4, 192), head[:, 4 * 192:]
    assert head.shape[1] == 4 * (192 + 1)
    for message, f, y in zip(async_messages[1:], features[1:], labels[1:]):
        assert sorted(y.long().tolist()) == sorted(batch_labels(message)), y
        assert f.std() > 0.1 and f.abs().max() < 10  # normalised pixels, one row per image
        assert len({tuple(row.tolist()) for row in f}) == 4  # four different images


def test_async_worker_visits_its_shard_in_a_new_order_each_epoch(async_messages):
    """Epoch 2 covers all 16 samples once, in batches other than epoch 1's."""
    batches = [sorted(batch_labels(m)) for m in async_messages[1:]]  # the first: not at zero
    first, second = batches[:3], batches[3:]
    assert sorted(sum(second, [])) == list(range(16)), second
    assert len(set(sum(first, []))) == 12
    assert first != second[1:], (first, second)


WITH_TRAINING_BATCH_HOOK = with_forward_hook(r"""
seen = []  # the centre pixel's red value of every training image this rank's model receives
def hook(module, args):
    if type(module).__name__ == "HW4ResNet" and module.training:
        seen.extend(args[0][:, 0, 16, 16].tolist())
def save():
    with open(os.environ["BATCHES_OUT"] + "." + os.environ["OMPI_COMM_WORLD_RANK"], "w") as f:
        json.dump(seen, f)
""")


def test_async_workers_split_the_training_set_and_reshard_it_each_epoch(tmp_path):
    """mpirun -np 3 async_sgd_cifar100.py (2 workers), 2 epochs of 48 images of one flat colour
    each (red = 5 x the image's index; a crop's shift or a flip keeps the centre pixel, and no
    TrivialAugment changes the colours): in each
    epoch the workers train on disjoint halves that together cover every image once, and the
    halves change between epochs (one permutation of the whole set per epoch, then sharded)."""
    n = 48
    red = np.arange(n, dtype=np.uint8) * 5
    images = np.stack([np.broadcast_to(np.array([r, 100, 200], np.uint8)[:, None, None],
                                       (3, 32, 32)) for r in red]).reshape(n, 3072)
    labels = np.arange(n) % 10
    write_cifar100_pickles(tmp_path / "data", (images, labels), (images[:8], labels[:8]))
    record = tmp_path / "batches"
    result = subprocess.run(
        [MPIRUN, "-np", "3", sys.executable, "-c", WITH_TRAINING_BATCH_HOOK,
         "async_sgd_cifar100.py", "--data-dir", str(tmp_path / "data"),
         "--out", str(tmp_path / "out"), "--epochs", "2", "--batch-size", "8",
         "--device", "cpu", "--no-amp", "--auto-augment", "none"],
        cwd=ROOT, env=child_env(BATCHES_OUT=str(record)), capture_output=True, text=True,
        timeout=TIMEOUT)
    assert result.returncode == 0, result.stdout + result.stderr
    mean, std = data.SPECS["cifar100"].mean[0], data.SPECS["cifar100"].std[0]

    def indices(rank):  # each image's index, from its normalised red value
        values = json.loads((tmp_path / f"batches.{rank}").read_text())
        return [round((v * std + mean) * 255 / 5) for v in values]

    assert indices(0) == []  # the server trains on nothing
    worker1, worker2 = indices(1), indices(2)
    assert len(worker1) == len(worker2) == 2 * n // 2  # 2 epochs of a half each
    for epoch in range(2):
        a = set(worker1[epoch * n // 2:(epoch + 1) * n // 2])
        b = set(worker2[epoch * n // 2:(epoch + 1) * n // 2])
        assert len(a) == len(b) == n // 2 and a.isdisjoint(b), (epoch, sorted(a), sorted(b))
        assert a | b == set(range(n))
    assert set(worker1[:n // 2]) != set(worker1[n // 2:])  # resharded, not only reordered


class _Done:
    def wait(self):
        pass


def server_rule(theta, sequence, n, lr_at, decay, head, head_gradient, mu=0.9, pull=0.2):
    """The async server's rule, stated again with plain tensors, for `sequence`'s gradients
    ((worker, gradient, features, labels), in the order they arrive; every worker starts from
    theta): the parameters it replies with after each, and those it ends with.  Its head's
    gradient is recomputed at the current parameters; a gradient 2 or more updates stale is
    pulled pull / n of the way back to where it was computed (not the head); the rest is
    torch's Nesterov step with weight decay and one momentum buffer per worker; the reply is
    theta extrapolated n - 1 updates along the buffers' mean."""
    sent = {w: (theta.clone(), 0) for w in range(1, n + 1)}  # parameters, the update they left
    v = {w: torch.zeros_like(theta) for w in sent}
    replies = []
    for version, (worker, g, features, labels) in enumerate(sequence):
        g = g.clone()
        g[head] = head_gradient(theta, features, labels)
        gap = theta - sent[worker][0]
        gap[head] = 0
        stale = version - sent[worker][1]
        d = g + decay * theta
        v[worker] = mu * v[worker] + d
        theta = theta - lr_at(version) * (d + mu * v[worker]) \
            - (pull / n if n > 1 and stale >= 2 else 0.0) * gap
        reply = theta - (n - 1) * lr_at(version + 1) / n * sum(v.values())
        sent[worker] = (reply, version + 1)
        replies.append((worker, reply))
    return replies, theta


@pytest.mark.parametrize("n", [1, 2, 4])
def test_async_server_applies_its_rule_to_stale_gradients(monkeypatch, n):
    """Gradients of n workers arriving in an irregular order (staleness 0 to several updates):
    the parameters the server replies with, in order and to whom, and those it ends with, are
    the rule's (`server_rule`); each update's staleness and whether it was pulled are counted.
    The head's gradient in each message is NaN: the server must recompute it, never use it."""
    sent = []
    monkeypatch.setattr(async_sgd_cifar100.dist, "isend",
                        lambda tensor, dst: sent.append((dst, tensor.clone())) or _Done())
    args = async_sgd_cifar100.parse_args(["--lr", "0.3", "--epochs", "3", "--warmup-epochs",
                                          "0.5", "--batch-size", str(2 * n)])
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(body=nn.Linear(4, 5), fc=nn.Linear(5, 3)))
    server = async_sgd_cifar100.Server(model, n, args, None, None, State(), 12, [0] * n, None)
    theta0 = server.theta.clone()
    decay = torch.tensor([args.weight_decay] * 20 + [0.0] * 5 + [args.weight_decay] * 15
                         + [0.0] * 3)  # the weights, not the biases
    head = slice(25, 43)

    def head_gradient(theta, features, labels):
        fc = nn.Linear(5, 3)
        with torch.no_grad():
            fc.weight.copy_(theta[25:40].view(3, 5))
            fc.bias.copy_(theta[40:])
        F.cross_entropy(fc(features), labels, label_smoothing=0.1).backward()
        return torch.cat([fc.weight.grad.reshape(-1), fc.bias.grad])

    order = [1, 2, 1, 3, 4, 4, 2, 1, 3, 3, 2, 4, 1, 1, 2, 3, 4, 2, 1, 4]
    rng = torch.Generator().manual_seed(1)
    sequence = []
    for worker in [w for w in order if w <= n]:
        samples = 1 + len(sequence) % 2  # 1 or 2 of the batch's 2 slots
        features = torch.randn(samples, 5, generator=rng)
        labels = torch.randint(0, 3, (samples,), generator=rng)
        sequence.append((worker, torch.randn(43, generator=rng), features, labels))
        head_slot = torch.zeros(2 * 5 + 2)
        head_slot[:samples * 5], head_slot[10:10 + samples] = features.reshape(-1), labels
        gradient = torch.cat([sequence[-1][1][:25], torch.full((18,), float("nan"))])
        message = torch.cat([torch.tensor([GRADIENT, samples, 1.0, 2.0]), gradient, head_slot])
        server.apply(worker, message)
        server.reply(worker, async_sgd_cifar100.CONTINUE, set(server.workers))
    lr_at = server.lr
    replies, theta = server_rule(theta0, sequence, n, lr_at, decay, head, head_gradient)
    assert [dst for dst, _ in sent] == [w for w, _ in replies]
    for step, ((_, got), (_, expected)) in enumerate(zip(sent, replies)):
        assert got[0] == async_sgd_cifar100.CONTINUE
        torch.testing.assert_close(got[1:], expected, rtol=1e-5, atol=1e-6, msg=f"reply {step}")
    torch.testing.assert_close(server.theta, theta, rtol=1e-5, atol=1e-6)
    assert (server.theta - theta0).abs().max() > 0.1  # it moved: the check has teeth
    staleness = [len(sequence[:i]) - max([j + 1 for j in range(i) if sequence[j][0] == w],
                                         default=0) for i, (w, *_) in enumerate(sequence)]
    assert server.epoch.staleness == staleness
    assert server.epoch.pulled == sum(s >= 2 for s in staleness) * (n > 1)
    if n == 4:
        assert max(staleness) >= 4 and 0 < server.epoch.pulled < len(sequence)


def test_every_mutant_still_applies_to_the_code_and_names_real_tests():
    """`python tests/mutants.py` edits the code by exact text and runs the tests it names: a
    change that removes a mutant's text, or renames its test, would drop that bug from the
    check until someone ran the whole list (minutes). Caught here in a second instead."""
    import mutants
    stale = {m.name: why for m in mutants.MUTANTS if (why := mutants.stale(m))}
    assert not stale, f"update these mutants along with the code and tests: {stale}"
