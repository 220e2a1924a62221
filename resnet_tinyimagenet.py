"""Train the HW4 ResNet (handout Figures 1 and 2) on TinyImageNet-200 (64x64, 200 classes).

    python resnet_tinyimagenet.py --data-dir ./data     # reads ./data/tiny-imagenet-200/

The validation split is built from val/val_annotations.txt in memory: the data folder is
only read, never modified.
"""
import torch
from torch import nn

from common import data, flags, loader, outputs, process, training
from common.checkpoint import Checkpoint
from common.model import build_model

SCRIPT = "resnet_tinyimagenet"
TARGET = 50.0  # the homework's test-accuracy target, % (on tinyimagenet)

# The recipe (every value is a flag): 40 epochs of batch 128; SGD with Nesterov momentum 0.9
# and weight decay 5e-4 on conv and linear weights; the learning rate warms up linearly to 0.1
# over the first epoch, then follows a cosine to 0, stepped every batch; random crop (8 px of
# zero padding at 64x64: 1/8 of the side) and horizontal flip; label smoothing 0.1 on the
# training loss only.
RECIPE = dict(epochs=40, batch_size=128, lr=0.1, momentum=0.9, weight_decay=5e-4,
              warmup_epochs=1.0, label_smoothing=0.1)


def parse_args(argv=None):
    parser = flags.make_parser(__doc__, SCRIPT, RECIPE, dataset="tinyimagenet", arch="hw4")
    return parser.parse_args(argv)


def train_one_epoch(model, meter, criterion, optimizer, scheduler, proc):
    """One pass over the training set: forward, backward and an SGD step for every batch."""
    model.train()
    for images, labels in meter:  # this epoch's batches, from where a stopped run left off
        with proc.autocast():
            output = model(images)
            loss = criterion(output, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()  # the learning rate changes every step
        meter.update(loss, output, labels)


def main(argv=None):
    args = parse_args(argv)
    proc = process.start(args, SCRIPT)  # device, precision, seeds, SIGTERM/SIGINT
    folder = outputs.RunFolder(args, proc, TARGET if args.dataset == "tinyimagenet" else None)

    train_set, test_set = data.load_datasets(args.dataset, args)
    train_loader, test_loader = loader.make_loaders(train_set, test_set, args, proc)
    model = proc.prepare(build_model(args.arch, len(train_set.classes), args.dropout))
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    optimizer = torch.optim.SGD(training.param_groups(model, args.weight_decay), lr=args.lr,
                                momentum=args.momentum, nesterov=args.momentum > 0, fused=True)
    scheduler = training.warmup_cosine(optimizer, args, len(train_loader))

    checkpoint = Checkpoint(args, proc, model, optimizer, scheduler)
    state = checkpoint.resume()  # the epochs done so far, if --out holds a checkpoint
    if args.evaluate:
        return training.evaluate_checkpoint(model, test_loader, proc, checkpoint, state)
    training.describe(proc, args, model, train_set, test_set, f"batch {args.batch_size}")
    folder.write_config(resumed_after_epoch=state.epoch)

    for epoch in range(state.epoch, args.epochs):
        meter = training.Meter(train_loader, epoch, args, proc, state, scheduler)
        train_one_epoch(model, meter, criterion, optimizer, scheduler, proc)
        if meter.stopped:  # SIGTERM / SIGINT: keep this step, and exit so that a rerun resumes
            checkpoint.save(state, partial=meter.partial())
            raise process.Interrupted(meter.stop_message(checkpoint.path), proc.stop.signum)
        test_loss, test_acc = training.evaluate(model, test_loader, proc)
        state.add(meter.row(test_loss, test_acc, state.rows))
        proc.log(training.epoch_line(state.rows[-1], args.epochs))
        checkpoint.save(state)  # resumable from here
        folder.write(state.rows)  # metrics.csv, curve.png (and tb/): as the checkpoint holds
    proc.log(f"final test accuracy: {state.rows[-1]['test_acc']:.2f}%")


if __name__ == "__main__":
    process.execute(main)
