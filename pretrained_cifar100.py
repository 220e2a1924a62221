"""Fine-tune torchvision's ImageNet-pretrained ResNet-18 on CIFAR-100.

    python pretrained_cifar100.py --data-dir ./data --weights resnet18-f37072fd.pth

The 1000-way head is replaced by a 100-way one.  CIFAR's 32x32 images are upsampled to
--image-size (224, as in the handout) on the training device, a whole batch at a time, and
normalised with ImageNet's statistics, which the pretrained filters expect.
"""
from common import cli, data, engine, weights
from common.errors import UserError
from common.model import build_model

SCRIPT = "pretrained_cifar100"
TARGET = 70.0  # the homework's test-accuracy target, % (on cifar100)


def parse_args(argv=None):
    parser = cli.make_parser(__doc__, SCRIPT, epochs=8, batch_size=128, lr=0.02)
    cli.add_workload_args(parser, dataset="cifar100", arch="resnet18",
                          image_size_help="side the images are upsampled (cifar100, "
                                          "tinyimagenet) or cropped (imagefolder) to")
    parser.set_defaults(image_size=224)
    parser.add_argument("--weights", metavar="PATH",
                        help="torchvision ImageNet state_dict file of --arch (default: "
                             "torchvision's weights API, i.e. the torch hub cache or a download)")
    parser.add_argument("--no-pretrained", action="store_true",
                        help="train the same network from random initialisation")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.arch not in weights.NAMES:
        raise UserError(f"--arch {args.arch} has no ImageNet weights; use "
                        f"{' or '.join(weights.NAMES)} (or resnet_cifar100.py for hw4)")
    run = cli.setup_run(args, SCRIPT)
    train_set, test_set = data.load_datasets(args.dataset, args)
    train_loader, test_loader = data.make_loaders(train_set, test_set, args, run,
                                                  pretrained=True)
    net = build_model(args.arch, len(train_set.classes))
    model = engine.prepare_model(net, run)
    trainer = engine.Trainer(model, train_loader, test_loader, args, run, arch=args.arch,
                             target=TARGET if args.dataset == "cifar100" else None)
    if not (args.no_pretrained or args.evaluate or trainer.will_resume()):
        source = args.weights or f"ImageNet {weights.NAMES[args.arch]} weights"
        state = weights.load_imagenet_state_dict(args.arch, args.weights)
        weights.load_backbone(net, state, source, args.arch)
        run.log(f"loaded {source}; new {len(train_set.classes)}-way head")
    engine.describe(run, args, model, train_set, test_set,
                    f"batch {args.batch_size}, images at {args.image_size}x{args.image_size}")
    trainer.evaluate_checkpoint() if args.evaluate else trainer.fit()


if __name__ == "__main__":
    cli.run_main(main)
