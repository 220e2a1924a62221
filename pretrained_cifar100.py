"""Fine-tune torchvision's ImageNet-pretrained ResNet-18 on CIFAR-100.

    python pretrained_cifar100.py --data-dir ./data --weights resnet18-f37072fd.pth

The 1000-way head is replaced by a 100-way one.  CIFAR's 32x32 images are upsampled to
--image-size (224, as in the handout) on the training device, a whole batch at a time, and
normalised with ImageNet's statistics, which the pretrained filters expect.
"""
from common import cli, data, engine, weights
from common.model import resnet18

SCRIPT = "pretrained_cifar100"
ARCH = "resnet18"
TARGET = 70.0  # the homework's test-accuracy target, %


def parse_args(argv=None):
    parser = cli.make_parser(__doc__, SCRIPT, epochs=8, batch_size=128, lr=0.02)
    parser.add_argument("--image-size", type=cli.positive_int, default=224,
                        help="side the 32x32 images are upsampled to")
    parser.add_argument("--weights", metavar="PATH",
                        help="torchvision ResNet-18 state_dict file (default: torchvision's "
                             "weights API, i.e. the torch hub cache or a download)")
    parser.add_argument("--no-pretrained", action="store_true",
                        help="train the same network from random initialisation")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    run = cli.setup_run(args, SCRIPT)
    spec = data.SPECS["cifar100"]
    train_set, test_set = data.load_datasets("cifar100", args)
    train_loader, test_loader = data.make_loaders(
        train_set, test_set, args, run, mean=data.IMAGENET_MEAN, std=data.IMAGENET_STD,
        image_size=args.image_size)
    net = resnet18(spec.num_classes)
    model = engine.prepare_model(net, run)
    trainer = engine.Trainer(model, train_loader, test_loader, args, run, arch=ARCH,
                             target=TARGET)
    if not (args.no_pretrained or args.evaluate or trainer.will_resume()):
        source = args.weights or "ImageNet weights"
        weights.load_backbone(net, weights.load_resnet18_state_dict(args.weights), source)
        run.log(f"loaded ImageNet ResNet-18 weights from {source}; new {spec.num_classes}-way head")
    engine.describe(run, ARCH, model, train_set, test_set,
                    f"batch {args.batch_size}, upsampled to {args.image_size}x{args.image_size}")
    trainer.evaluate_checkpoint() if args.evaluate else trainer.fit()


if __name__ == "__main__":
    cli.run_main(main)
