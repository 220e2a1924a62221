"""bench/batched.py, the many-seeds-at-once simulator, computes what the scripts compute.

Its figures would choose the async rule, so each of its pieces is checked against the real
one: every copy's gradient and BatchNorm statistics against a plain model's, the batched
server against async_sgd_cifar100.Server (update, reply, staleness, pull and fresh head), the
batched sync step against torch.optim.SGD; and the command line end to end, on tiny sizes.
"""
import json
import os
import statistics
import sys

import pytest
import torch
import torch.nn.functional as F

import async_sgd_cifar100
from common import loader, training
from common.checkpoint import State
from common.model import build_model
from helpers import ROOT, markdown_rows

sys.path.insert(0, os.path.join(ROOT, "bench"))
import batched  # noqa: E402

CPU = torch.device("cpu")


class _Done:
    def wait(self):
        pass


def plain_model(copies, c, buffers):
    """A plain HW4 ResNet holding copy c's parameters and the given BatchNorm statistics."""
    model = build_model("hw4", copies.num_classes, 0.0)
    with torch.no_grad():
        for p, t in zip(model.parameters(), copies.views(copies.sent).values()):
            p.copy_(t[c])
        for name, b in model.named_buffers():
            b.copy_(buffers[name][c])
    return model.train()


def test_every_copy_gets_its_own_gradient_and_batchnorm_statistics():
    """Four copies (2 seeds x 2 workers) at different parameters, each on its own batch: each
    gradient, loss and BatchNorm update equals a plain model's.  A vmap that shared
    BatchNorm statistics across copies, or mixed up their order, fails here."""
    copies = batched.Copies([0, 1], 2, 100, CPU, 0.1)
    copies.body.dropout.p = 0.0  # masks differ between vmap and a plain model
    torch.manual_seed(1)
    copies.sent += 0.01 * torch.randn_like(copies.sent)
    x, y = torch.randn(4, 6, 3, 32, 32), torch.randint(0, 100, (4, 6))
    x[2] *= 3.0  # one copy's batch with other statistics
    before = {name: b.clone() for name, b in copies.buffers.items()}
    features, losses = copies.gradients(x, y)
    assert features.shape == (2, 2, 6, 256)
    for c in range(4):
        model = plain_model(copies, c, before)
        loss = F.cross_entropy(model(x[c]), y[c], label_smoothing=0.1)
        loss.backward()
        expected = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        error = (copies.grads[c] - expected).abs().max() / expected.abs().max()
        assert error < 2e-4, (c, error)  # fp32 sums in another order: ~1e-5
        assert abs(losses[c].item() - loss.item()) < 1e-5
        for name, b in model.named_buffers():
            assert torch.allclose(copies.buffers[name][c].float(), b.float(), atol=1e-5), name
    assert not torch.equal(copies.grads[0], copies.grads[1])


@pytest.mark.parametrize("variant", ["default", "--pull 0.4 --pull-from 0", "--ahead 0",
                                     "--no-fresh-head --pull 0.3",
                                     "--ahead 4 --pull 0.6 --pull-from 0 --pull-centered"])
def test_the_batched_server_applies_and_replies_as_the_scripts_server(monkeypatch, variant):
    """Three workers whose turns come out of order (staleness 0 to 4): after each turn the
    batched server's parameters and its reply to that worker equal async_sgd_cifar100.Server's
    given the same gradient, features and labels -- with the script's default rule and with
    each of its flags the simulator passes on."""
    replies = []
    monkeypatch.setattr(async_sgd_cifar100.dist, "isend",
                        lambda tensor, dst: replies.append(tensor.clone()) or _Done())
    text, rule = batched.parse_variant(variant)
    n, per_worker = 3, 4
    flags = [] if text == "default" else text.split()
    args = async_sgd_cifar100.parse_args(["--lr", "0.15", "--epochs", "2", "--batch-size",
                                          str(n * per_worker), *flags])
    copies = batched.Copies([5], n, 100, CPU, args.label_smoothing)
    torch.manual_seed(5)
    model = build_model("hw4", 100, 0.1)
    server = async_sgd_cifar100.Server(model, n, args, None, None, State(), 10, None, None)
    assert torch.equal(server.theta, copies.theta[0])
    fake = batched.AsyncServer(copies, rule, args, 10)
    layout = server.layout
    torch.manual_seed(0)
    for w in [0, 1, 2, 2, 0, 1, 1, 1, 0, 2, 0]:
        g = 0.1 * torch.randn(copies.P)
        features = torch.rand(1, n, per_worker, 256) * 5
        labels = torch.randint(0, 100, (1, n, per_worker))
        message = torch.zeros(layout.message_size)
        message[:4] = torch.tensor([async_sgd_cifar100.GRADIENT, per_worker, 0.0, 0.0])
        message[4:4 + copies.P] = g
        if layout.n_head:
            head = message[4 + layout.n_params + layout.n_buffers:]
            head[:per_worker * 256] = features[0, w].reshape(-1)
            head[layout.batch * 256:][:per_worker] = labels[0, w].float()
        server.apply(w + 1, message)
        server.reply(w + 1, async_sgd_cifar100.CONTINUE)
        copies.grads.view(1, n, -1)[0, w] = g
        staleness = fake.turn(w, features, labels)
        assert staleness == server.staleness[-1]
        assert torch.allclose(copies.theta[0], server.theta, atol=2e-6), (w, staleness)
        assert torch.allclose(copies.sent[w], replies[-1][1:], atol=2e-6), (w, staleness)
    assert max(server.staleness) >= 3 and min(server.staleness) == 0


def test_batched_sync_is_torch_sgd_with_nesterov_momentum():
    """One seed, one rank, the same gradients: the batched sync step is
    torch.optim.SGD(nesterov=True) with the scripts' weight decay groups and schedule, step
    for step (weight decay raised so that a slip in it shows)."""
    args = batched.parse_args(["--epochs", "2", "--workers", "1", "--weight-decay", "0.05",
                               "--device", "cpu"])
    copies = batched.Copies([3], 1, 100, CPU, 0.1)
    sync = batched.SyncServer(copies, args, 4)
    torch.manual_seed(3)
    model = build_model("hw4", 100, 0.0).train()
    optimizer = torch.optim.SGD(training.param_groups(model, args.weight_decay), lr=args.lr,
                                momentum=0.9, nesterov=True)
    scheduler = training.warmup_cosine(optimizer, args, 4)
    for step in range(8):
        x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 100, (8,))
        optimizer.zero_grad()
        F.cross_entropy(model(x), y, label_smoothing=0.1).backward()
        copies.grads[0] = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        sync.round()
        optimizer.step()
        scheduler.step()
        theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        assert torch.allclose(copies.theta[0], theta, atol=1e-6), step
        assert torch.equal(copies.sent[0], copies.theta[0])


def test_the_command_line_trains_every_variant_and_reports_the_gap(tmp_path, capsys):
    out = tmp_path / "results.jsonl"
    batched.main(["--train", "32", "--test", "16", "--epochs", "2", "--batch-size", "16",
                  "--lr", "0.05", "--workers", "2", "--seeds", "0-1", "--device", "cpu",
                  "--variants", "sync", "default", "--pull 0.4 --pull-from 0", "--json", str(out)])
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["variant"] for r in results] == ["sync", "default", "--pull 0.4 --pull-from 0"]
    for r in results:
        assert len(r["test_acc"]) == 2 and all(len(epoch) == 2 for epoch in r["test_acc"])
        assert all(0.0 <= a <= 100.0 for epoch in r["test_acc"] for a in epoch)
        assert len(r["train_loss"]) == 2 and all(len(epoch) == 2 for epoch in r["train_loss"])
        assert all(0.0 < v < 20.0 for epoch in r["train_loss"] for v in epoch)
    assert results[0]["staleness"] == []
    # the turns in the same order every round (--order fixed, as in the real runs): after the
    # first turn of all, every gradient is exactly N - 1 = 1 update stale
    assert results[1]["staleness"] == [[0.75, 1], [1.0, 1]]
    # which the default's gate leaves unpulled; the variant's flags pull them
    assert results[2]["train_loss"] != results[1]["train_loss"]
    table = markdown_rows(capsys.readouterr().out)
    rows = {row[0]: row for row in table}
    assert rows["default"][1] == "2", table
    # the gaps to sync, paired by seed: test accuracy, then training loss
    for column, key, digits in ((4, "test_acc", 2), (8, "train_loss", 3)):
        gaps = [a - s for a, s in zip(results[1][key][-1], results[0][key][-1])]
        assert rows["default"][column] == f"{statistics.mean(gaps):.{digits}f}", table
    assert rows["sync"][4] == "", table
    # --stop-after 1 trains the first epoch of the same 2-epoch schedule, not a 1-epoch one
    # (with half an epoch of warm-up, the two schedules differ within the first epoch)
    runs = []
    for stop in ([], ["--stop-after", "1"]):
        path = tmp_path / f"stop{len(stop)}.jsonl"
        batched.main(["--train", "32", "--test", "16", "--epochs", "2", "--warmup-epochs",
                      "0.5", "--batch-size", "16", "--workers", "2", "--seeds", "0-1",
                      "--device", "cpu", "--variants", "default", "--json", str(path), *stop])
        runs.append(json.loads(path.read_text()))
    whole, stopped = runs
    assert len(stopped["train_loss"]) == 1 and len(whole["train_loss"]) == 2
    assert stopped["train_loss"] == whole["train_loss"][:1]
    assert stopped["test_acc"] == whole["test_acc"][:1]
    # a budget the first variant already used up: the others are skipped, with a line each
    batched.main(["--train", "32", "--test", "16", "--epochs", "1", "--batch-size", "16",
                  "--workers", "2", "--seeds", "0", "--device", "cpu", "--variants", "sync",
                  "default", "--ahead 0", "--budget", "0.001", "--json", str(out)])
    assert len(out.read_text().splitlines()) == 4
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if line.startswith("skipped")] == [
        "skipped 'default': it would end after the 0.001 s budget",
        "skipped '--ahead 0': it would end after the 0.001 s budget"]


def test_a_variant_that_is_not_the_rules_flags_is_one_error_line(capsys):
    with pytest.raises(SystemExit) as stop:
        batched.parse_args(["--variants", "default", "--pull x"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "--variants '--pull x': argument --pull: invalid float value: 'x'" in err[-1]
    assert sum("error:" in line for line in err) == 1, err  # argparse's usage, one error
