"""Train the HW4 ResNet (handout Figures 1 and 2) on CIFAR-100 and plot its test accuracy.

    python resnet_cifar100.py --data-dir ./data     # reads ./data/cifar-100-python/
"""
import torch
from torch import nn

from common import data, flags, training
from common.loader import make_loader
from common.model import build_model
from common.outputs import RunFolder
from common.run import execute, start_run

SCRIPT = "resnet_cifar100"
TARGET = 60.0  # the homework's test-accuracy target, % (on cifar100)

# The recipe, every value a flag, with what each part is for:
RECIPE = dict(epochs=40, batch_size=128,  # the homework's budget
              lr=0.1, momentum=0.9,  # SGD, Nesterov momentum: smooths the noisy batch gradients
              warmup_epochs=1.0,  # up to --lr over epoch 1, then a cosine to 0: no early blow-up
              weight_decay=5e-4,  # on conv and linear weights only: less memorising
              label_smoothing=0.1,  # training loss only: soft targets, no over-confident logits
              auto_augment="ta_wide")  # TrivialAugment after crop (4 px) and flip: less memorising


def parse_args(argv=None):
    parser = flags.make_parser(__doc__, SCRIPT, RECIPE, dataset="cifar100", arch="hw4")
    return parser.parse_args(argv)


def train_one_epoch(model, criterion, optimizer, scheduler, train_loader, epoch, run,
                    resumed=None):
    """One pass over the training set: forward, backward and an SGD step for every batch (from
    the batch a stopped pass reached, `resumed`); its metrics, stopped early by SIGTERM/SIGINT."""
    model.train()
    metrics = training.EpochMetrics(run, epoch, len(train_loader), scheduler.get_last_lr()[0],
                                    resumed)
    for images, labels in train_loader.epoch_batches(epoch, start=metrics.step):
        with run.autocast():
            output = model(images)
            loss = criterion(output, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()  # the learning rate changes every step
        metrics.update(loss, output, labels)
        if run.stop.signum:  # asked to stop: after this step, so that a rerun resumes here
            return metrics.end(stopped=True)
    return metrics.end()


def main(argv=None):
    args = parse_args(argv)
    run = start_run(args, SCRIPT)  # device, precision, seeds; SIGTERM/SIGINT stop cleanly
    folder = RunFolder(args, run, TARGET if args.dataset == "cifar100" else None)

    train_set, test_set = data.load_datasets(args.dataset, args)
    train_loader = make_loader(train_set, args, run, train=True)
    test_loader = make_loader(test_set, args, run, train=False)
    model = run.prepare(build_model(args.arch, len(train_set.classes), args.dropout))
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    optimizer = torch.optim.SGD(training.param_groups(model, args.weight_decay), lr=args.lr,
                                momentum=args.momentum, nesterov=args.momentum > 0, fused=True)
    scheduler = training.warmup_cosine(optimizer, args, len(train_loader))

    state = folder.resume(model, optimizer, scheduler)  # the epochs a checkpoint in --out holds
    if args.evaluate:
        return training.evaluate_checkpoint(model, test_loader, run, state)
    run.log(training.describe(run, args, model, train_set, test_set, f"batch {args.batch_size}"))
    folder.write_config(state)

    for epoch in range(state.epoch, args.epochs):
        metrics = train_one_epoch(model, criterion, optimizer, scheduler, train_loader, epoch,
                                  run, state.take_partial())
        if metrics.stopped:
            folder.stop(state, metrics)  # checkpoint this step, exit with 128 + signal
        test_loss, test_acc = training.evaluate(model, test_loader, run)
        # the epoch's line; checkpoint.pt, metrics.csv and curve.png rewritten
        folder.end_epoch(state, metrics.row(test_loss, test_acc, state.rows))
    run.log(f"final test accuracy: {state.rows[-1]['test_acc']:.2f}%")


if __name__ == "__main__":
    execute(main)
