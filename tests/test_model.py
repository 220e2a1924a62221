"""The HW4 ResNet against the handout's Figure 1 (network) and Figure 2 (basic block)."""
import pytest
import torch
from torch import nn

from common import model as model_module
from common.model import HW4ResNet

# Figure 1, written out again here (not imported from the model): per stage the output
# channels, the number of basic blocks and the stride of its first block.
FIG1_STAGES = [("conv2_x", 32, 2, 1), ("conv3_x", 64, 4, 2),
               ("conv4_x", 128, 4, 2), ("conv5_x", 256, 2, 2)]


def figure1_parameter_count(num_classes):
    """Parameters of Figure 1 counted by hand: bias-free convs, BN (weight + bias), FC."""
    def conv(cin, cout, k):
        return cin * cout * k * k

    def bn(c):
        return 2 * c

    total = conv(3, 32, 3) + bn(32)                      # conv1 + its BN
    cin = 32
    for _, cout, blocks, stride in FIG1_STAGES:
        for b in range(blocks):
            s = stride if b == 0 else 1
            total += conv(cin, cout, 3) + bn(cout) + conv(cout, cout, 3) + bn(cout)
            if s != 1 or cin != cout:                    # projection shortcut: 1x1 conv + BN
                total += conv(cin, cout, 1) + bn(cout)
            cin = cout
    total += 256 * num_classes + num_classes             # FC
    return total


def _leaf_trace(module, x):
    """Run `module(x)` (eval mode) and return [(leaf module, input clone, output clone)] in
    call order.  Clones, because in-place ReLUs overwrite the tensors afterwards."""
    calls, hooks = [], []
    for m in module.modules():
        if len(list(m.children())) == 0 and not isinstance(m, nn.Identity):
            hooks.append(m.register_forward_hook(
                lambda mod, inp, out: calls.append((mod, inp[0].detach().clone(),
                                                    out.detach().clone()))))
    try:
        with torch.no_grad():
            out = module(x)
    finally:
        for h in hooks:
            h.remove()
    return calls, out


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return HW4ResNet(100).eval()


@pytest.mark.parametrize("num_classes,size", [(100, 32), (200, 64)])
def test_output_shape(num_classes, size):
    torch.manual_seed(0)
    net = HW4ResNet(num_classes).eval()
    with torch.no_grad():
        out = net(torch.randn(3, 3, size, size))
    assert out.shape == (3, num_classes)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("num_classes", [100, 200])
def test_parameter_count_matches_figure1(num_classes):
    net = HW4ResNet(num_classes)
    expected = figure1_parameter_count(num_classes)
    assert sum(p.numel() for p in net.parameters()) == expected
    assert sum(p.numel() for p in net.parameters()) == expected
    if num_classes == 100:
        assert expected == 3_559_556  # the hand count itself, so it cannot drift unnoticed


def test_stem_is_conv_bn_relu_dropout(model):
    conv = model.conv1
    assert isinstance(conv, nn.Conv2d)
    assert (conv.in_channels, conv.out_channels) == (3, 32)
    assert conv.kernel_size == (3, 3) and conv.stride == (1, 1) and conv.padding == (1, 1)
    calls, _ = _leaf_trace(model, torch.randn(2, 3, 32, 32))
    kinds = [type(m) for m, _, _ in calls[:4]]
    assert kinds == [nn.Conv2d, nn.BatchNorm2d, nn.ReLU, nn.Dropout]
    assert calls[0][0] is conv and calls[1][0].num_features == 32
    # the first block sees the dropout's output, which is ReLU'd (non-negative)
    assert calls[4][1].min() >= 0
    torch.testing.assert_close(calls[4][1], calls[3][2])


def test_dropout_probability_is_an_argument():
    ps = {m.p for m in HW4ResNet(100, dropout=0.3).modules() if isinstance(m, nn.Dropout)}
    assert ps == {0.3}


def _convs(block):
    return [m for m in block.modules() if isinstance(m, nn.Conv2d)]


def test_stages_blocks_strides_and_shortcuts(model):
    cin = 32
    for name, cout, blocks, stride in FIG1_STAGES:
        stage = getattr(model, name)
        assert len(stage) == blocks, name
        for b, block in enumerate(stage):
            s = stride if b == 0 else 1
            convs = _convs(block)
            k3 = [c for c in convs if c.kernel_size == (3, 3)]
            k1 = [c for c in convs if c.kernel_size == (1, 1)]
            assert len(k3) == 2 and len(k3) + len(k1) == len(convs), (name, b)
            for c in k3:
                assert c.padding == (1, 1), (name, b)
            assert (k3[0].in_channels, k3[0].out_channels, k3[0].stride) == (cin, cout, (s, s))
            assert (k3[1].in_channels, k3[1].out_channels, k3[1].stride) == (cout, cout, (1, 1))
            projection = b == 0 and name != "conv2_x"
            assert len(k1) == (1 if projection else 0), (name, b)
            if projection:
                assert s == 2
                p = k1[0]
                assert (p.in_channels, p.out_channels, p.stride) == (cin, cout, (2, 2))
            cin = cout
    assert isinstance(model.fc, nn.Linear) and model.fc.in_features == 256
    assert model.fc.out_features == 100


@pytest.mark.parametrize("post_add_relu", [True, False])
def test_block_follows_figure2(post_add_relu):
    """conv3x3 -> BN -> ReLU -> conv3x3 -> BN, + shortcut (identity or 1x1 conv + BN),
    then ReLU only with post_add_relu=True; checked on the values that flow through."""
    torch.manual_seed(0)
    net = HW4ResNet(100, post_add_relu=post_add_relu).eval()
    # randomise BN statistics/affine so that no layer is (close to) an identity
    for m in net.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.5, 0.5)
    for name, block, x in [("conv2_x", net.conv2_x[1], torch.randn(2, 32, 8, 8)),
                           ("conv3_x", net.conv3_x[0], torch.randn(2, 32, 8, 8))]:
        calls, out = _leaf_trace(block, x)
        projection = name == "conv3_x"
        # separate the shortcut's 1x1 conv (and the BN fed by it) from the main path
        short = [i for i, (m, _, _) in enumerate(calls)
                 if isinstance(m, nn.Conv2d) and m.kernel_size == (1, 1)]
        assert len(short) == (1 if projection else 0)
        shortcut_out = x
        if projection:
            i = short[0]
            bn_i = next(j for j, (m, inp, _) in enumerate(calls)
                        if isinstance(m, nn.BatchNorm2d) and torch.equal(inp, calls[i][2]))
            shortcut_out = calls[bn_i][2]
            assert not torch.equal(shortcut_out, calls[i][2])  # the BN did something
            main = [c for j, c in enumerate(calls) if j not in (i, bn_i)]
        else:
            main = calls
        kinds = [type(m) for m, _, _ in main]
        expected = [nn.Conv2d, nn.BatchNorm2d, nn.ReLU, nn.Conv2d, nn.BatchNorm2d]
        assert kinds == expected + ([nn.ReLU] if post_add_relu else []), name
        # data flow of the main path
        torch.testing.assert_close(main[0][1], x)
        torch.testing.assert_close(main[1][1], main[0][2])
        torch.testing.assert_close(main[2][2], torch.relu(main[1][2]))
        torch.testing.assert_close(main[3][1], main[2][2])
        torch.testing.assert_close(main[4][1], main[3][2])
        added = main[4][2] + shortcut_out
        torch.testing.assert_close(out, torch.relu(added) if post_add_relu else added)


def test_post_add_relu_false_really_drops_the_relu():
    torch.manual_seed(0)
    x = torch.randn(4, 32, 8, 8)
    outs = {}
    for flag in (True, False):
        torch.manual_seed(1)
        net = HW4ResNet(100, post_add_relu=flag).eval()
        with torch.no_grad():
            outs[flag] = net.conv2_x[0](x)
    assert outs[True].min() >= 0
    assert outs[False].min() < 0
    # same weights (same seed): the only difference is the final ReLU
    torch.testing.assert_close(outs[True], torch.relu(outs[False]))

    # and through the whole network, the last stage's output
    seen = {}
    for flag in (True, False):
        torch.manual_seed(1)
        net = HW4ResNet(100, post_add_relu=flag).eval()
        h = net.conv5_x.register_forward_hook(lambda m, i, o, f=flag: seen.__setitem__(f, o.clone()))
        with torch.no_grad():
            net(torch.randn(2, 3, 32, 32))
        h.remove()
    assert seen[True].min() >= 0 and seen[False].min() < 0


@pytest.mark.parametrize("size,spatial", [(32, 4), (64, 8)])
def test_max_pool_input_size_and_fc(size, spatial):
    torch.manual_seed(0)
    net = HW4ResNet(100).eval()
    calls, out = _leaf_trace(net, torch.randn(2, 3, size, size))
    pool_i, (pool, pin, pout) = next((i, c) for i, c in enumerate(calls)
                                     if isinstance(c[0], (nn.MaxPool2d, nn.AdaptiveMaxPool2d)))
    assert pin.shape == (2, 256, spatial, spatial)
    # a max pool to 1x1: the maximum over the whole map
    torch.testing.assert_close(pout.reshape(2, 256), pin.amax(dim=(2, 3)))
    fc, fin, fout = calls[-1]
    assert isinstance(fc, nn.Linear) and pool_i == len(calls) - 2
    torch.testing.assert_close(fin, pout.reshape(2, 256))
    torch.testing.assert_close(out, fout)


def _torchvision_resnet18(num_classes):
    if hasattr(model_module, "build_model"):
        return model_module.build_model("resnet18", num_classes)
    return model_module.resnet18(num_classes)


def test_resnet18_head():
    net = _torchvision_resnet18(100)
    assert net.fc.in_features == 512 and net.fc.out_features == 100
    with torch.no_grad():
        assert net.eval()(torch.randn(1, 3, 32, 32)).shape == (1, 100)
