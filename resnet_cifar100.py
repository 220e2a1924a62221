"""Train the HW4 ResNet (handout Figures 1 and 2) on CIFAR-100 and plot its test accuracy.

    python resnet_cifar100.py --data-dir ./data     # reads ./data/cifar-100-python/
"""
from common import cli, data, engine
from common.model import HW4ResNet

SCRIPT = "resnet_cifar100"
ARCH = "hw4-resnet"
TARGET = 60.0  # the homework's test-accuracy target, %


def parse_args(argv=None):
    parser = cli.make_parser(__doc__, SCRIPT, epochs=40, batch_size=128, lr=0.1)
    parser.add_argument("--dropout", type=float, default=0.1,
                        help="dropout probability after conv1 (Figure 1)")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    run = cli.setup_run(args, SCRIPT)
    spec = data.SPECS["cifar100"]
    train_set, test_set = data.load_datasets("cifar100", args)
    train_loader, test_loader = data.make_loaders(train_set, test_set, args, run,
                                                  mean=spec.mean, std=spec.std)
    model = engine.prepare_model(HW4ResNet(spec.num_classes, dropout=args.dropout), run)
    engine.describe(run, ARCH, model, train_set, test_set, f"batch {args.batch_size}")
    trainer = engine.Trainer(model, train_loader, test_loader, args, run, arch=ARCH,
                             target=TARGET)
    trainer.evaluate_checkpoint() if args.evaluate else trainer.fit()


if __name__ == "__main__":
    cli.run_main(main)
