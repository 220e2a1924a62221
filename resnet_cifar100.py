"""Train the HW4 ResNet (handout Figures 1 and 2) on CIFAR-100 and plot its test accuracy.

    python resnet_cifar100.py --data-dir ./data     # reads ./data/cifar-100-python/
"""

from common import cli, data, engine
from common.model import build_model

SCRIPT = "resnet_cifar100"
TARGET = 60.0  # the homework's test-accuracy target, % (on cifar100)


def parse_args(argv=None):
    parser = cli.make_parser(__doc__, SCRIPT, epochs=40, batch_size=128, lr=0.1)
    cli.add_workload_args(parser, dataset="cifar100", arch="hw4")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    run = cli.setup_run(args, SCRIPT)
    train_set, test_set = data.load_datasets(args.dataset, args)
    train_loader, test_loader = data.make_loaders(train_set, test_set, args, run)
    model = build_model(args.arch, len(train_set.classes), args.dropout)
    model = engine.prepare_model(model, run)
    engine.describe(run, args, model, train_set, test_set, f"batch {args.batch_size}")
    trainer = engine.Trainer(model, train_loader, test_loader, args, run, arch=args.arch,
                             target=TARGET if args.dataset == "cifar100" else None)
    trainer.evaluate_checkpoint() if args.evaluate else trainer.fit()


if __name__ == "__main__":
    cli.run_main(main)
