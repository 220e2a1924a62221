"""Fine-tune torchvision's ImageNet-pretrained ResNet-18 on CIFAR-100.

    python pretrained_cifar100.py --data-dir ./data --weights resnet18-f37072fd.pth

The 1000-way head is replaced by a 100-way one.  CIFAR's 32x32 images are upsampled to
--image-size (224, as in the handout) on the training device, a whole batch at a time, and
normalised with ImageNet's statistics, which the pretrained filters expect.
"""
import torch
from torch import nn

from common import data, flags, model as models, training
from common.loader import make_loader
from common.outputs import RunFolder
from common.run import UserError, execute, start_run

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
    if args.arch not in models.NAMES:
        raise UserError(f"--arch {args.arch} has no ImageNet weights; use "
                        f"{' or '.join(models.NAMES)} (or resnet_cifar100.py for hw4)")
    run = start_run(args, SCRIPT)  # device, precision, seeds; SIGTERM/SIGINT stop cleanly
    folder = RunFolder(args, run, TARGET if args.dataset == "cifar100" else None)

    train_set, test_set = data.load_datasets(args.dataset, args)
    # ImageNet's mean and std: what the pretrained filters expect
    train_loader = make_loader(train_set, args, run, train=True, pretrained=True)
    test_loader = make_loader(test_set, args, run, train=False, pretrained=True)
    model = run.prepare(models.build_model(args.arch, len(train_set.classes)))
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    optimizer = torch.optim.SGD(training.param_groups(model, args.weight_decay), lr=args.lr,
                                momentum=args.momentum, nesterov=args.momentum > 0, fused=True)
    scheduler = training.warmup_cosine(optimizer, args, len(train_loader))

    state = folder.resume(model, optimizer, scheduler)  # the epochs a checkpoint in --out holds
    if not (args.no_pretrained or args.evaluate or state.epoch or state.partial):  # a new run
        source = args.weights or f"ImageNet {models.NAMES[args.arch]} weights"
        state_dict = models.load_imagenet_state_dict(args.arch, args.weights)
        models.load_backbone(model, state_dict, source, args.arch)  # all but the new head
        run.log(f"loaded {source}; new {len(train_set.classes)}-way head")
    if args.evaluate:
        return training.evaluate_checkpoint(model, test_loader, run, state)
    run.log(training.describe(run, args, model, train_set, test_set, f"batch {args.batch_size}, "
                              f"images at {args.image_size}x{args.image_size}"))
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
