"""Fine-tune torchvision's ImageNet-pretrained ResNet-18 on CIFAR-100.

    python pretrained_cifar100.py --data-dir ./data --weights resnet18-f37072fd.pth

The 1000-way head is replaced by a 100-way one.  CIFAR's 32x32 images are upsampled to
--image-size (224, as in the handout) on the training device, a whole batch at a time, and
normalised with ImageNet's statistics, which the pretrained filters expect.
"""
import torch
from torch import nn

from common import data, flags, loader, outputs, process, training
from common.checkpoint import Checkpoint
from common import model as models

SCRIPT = "pretrained_cifar100"
TARGET = 70.0  # the homework's test-accuracy target, % (on cifar100)

# The recipe (every value is a flag): 8 epochs of batch 128 at 224x224; SGD with Nesterov
# momentum 0.9 and weight decay 5e-4 on conv and linear weights; the learning rate warms up
# linearly to 0.02 (fine-tuning: a fifth of training from scratch) over the first epoch, then
# follows a cosine to 0, stepped every batch; random crop (4 px of zero padding, before the
# upsampling) and horizontal flip; label smoothing 0.1 on the training loss only.
RECIPE = dict(epochs=8, batch_size=128, lr=0.02, momentum=0.9, weight_decay=5e-4,
              warmup_epochs=1.0, label_smoothing=0.1, image_size=224)


def parse_args(argv=None):
    parser = flags.make_parser(__doc__, SCRIPT, RECIPE, dataset="cifar100", arch="resnet18")
    parser.add_argument("--weights", metavar="PATH",
                        help="torchvision ImageNet state_dict file of --arch (default: "
                             "torchvision's weights API, i.e. the torch hub cache or a download)")
    parser.add_argument("--no-pretrained", action="store_true",
                        help="train the same network from random initialisation")
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
    if args.arch not in models.NAMES:
        raise process.UserError(f"--arch {args.arch} has no ImageNet weights; use "
                                f"{' or '.join(models.NAMES)} (or resnet_cifar100.py for hw4)")
    proc = process.start(args, SCRIPT)  # device, precision, seeds, SIGTERM/SIGINT
    folder = outputs.RunFolder(args, proc, TARGET if args.dataset == "cifar100" else None)

    train_set, test_set = data.load_datasets(args.dataset, args)
    train_loader, test_loader = loader.make_loaders(train_set, test_set, args, proc,
                                                    pretrained=True)  # ImageNet's mean and std
    model = proc.prepare(models.build_model(args.arch, len(train_set.classes)))
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    optimizer = torch.optim.SGD(training.param_groups(model, args.weight_decay), lr=args.lr,
                                momentum=args.momentum, nesterov=args.momentum > 0, fused=True)
    scheduler = training.warmup_cosine(optimizer, args, len(train_loader))

    checkpoint = Checkpoint(args, proc, model, optimizer, scheduler)
    if not (args.no_pretrained or args.evaluate or checkpoint.exists()):
        source = args.weights or f"ImageNet {models.NAMES[args.arch]} weights"
        state_dict = models.load_imagenet_state_dict(args.arch, args.weights)
        models.load_backbone(model, state_dict, source, args.arch)  # all but the new head
        proc.log(f"loaded {source}; new {len(train_set.classes)}-way head")
    state = checkpoint.resume()  # the epochs done so far, if --out holds a checkpoint
    if args.evaluate:
        return training.evaluate_checkpoint(model, test_loader, proc, checkpoint, state)
    training.describe(proc, args, model, train_set, test_set,
                      f"batch {args.batch_size}, images at {args.image_size}x{args.image_size}")
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
