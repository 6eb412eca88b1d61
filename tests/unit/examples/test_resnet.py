import math

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from trainpod.examples.resnet import ARCHS, resnet18, resnet50  # noqa: E402

RESNET50_PARAMETERS = 25_557_032  # torchvision's resnet50(), 1000 classes
# 53 convolutions (stem, 16 blocks x 3, 4 shortcut projections), each with a BatchNorm of 5 entries
# (weight, bias, running_mean, running_var, num_batches_tracked), plus fc's weight and bias.
STATE_DICT_KEYS = 53 + 53 * 5 + 2
# The BatchNorms cover 26,560 channels; their running statistics add 2 * 26,560 + 53 to the parameters.
STATE_DICT_NUMEL = RESNET50_PARAMETERS + 2 * 26_560 + 53


def expected_state_dict_shapes(num_classes=1000):
    """torchvision's resnet50 state_dict keys, in order, with shapes, written out from the architecture."""
    shapes = []

    def conv(name, out_channels, in_channels, k):
        shapes.append((f"{name}.weight", (out_channels, in_channels, k, k)))

    def norm(name, channels):
        shapes.extend((f"{name}.{key}", (channels,)) for key in ("weight", "bias", "running_mean", "running_var"))
        shapes.append((f"{name}.num_batches_tracked", ()))

    conv("conv1", 64, 3, 7)
    norm("bn1", 64)
    channels = 64
    for stage, (blocks, width) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512)), start=1):
        for block in range(blocks):
            prefix = f"layer{stage}.{block}"
            conv(f"{prefix}.conv1", width, channels, 1)
            norm(f"{prefix}.bn1", width)
            conv(f"{prefix}.conv2", width, width, 3)
            norm(f"{prefix}.bn2", width)
            conv(f"{prefix}.conv3", 4 * width, width, 1)
            norm(f"{prefix}.bn3", 4 * width)
            if block == 0:
                conv(f"{prefix}.downsample.0", 4 * width, channels, 1)
                norm(f"{prefix}.downsample.1", 4 * width)
            channels = 4 * width
    shapes.append(("fc.weight", (num_classes, 2048)))
    shapes.append(("fc.bias", (num_classes,)))
    return shapes


def test_parameter_count():
    model = resnet50()
    assert sum(p.numel() for p in model.parameters()) == RESNET50_PARAMETERS
    assert len(list(model.parameters())) == 161


@pytest.mark.slow
def test_state_dict_keys_and_shapes():
    state = resnet50().state_dict()
    assert [(k, tuple(v.shape)) for k, v in state.items()] == expected_state_dict_shapes()
    assert len(state) == STATE_DICT_KEYS == 320
    assert sum(v.numel() for v in state.values()) == STATE_DICT_NUMEL
    # A few spot checks, spelled out.
    assert state["layer3.5.conv2.weight"].shape == (256, 256, 3, 3)
    assert state["layer2.0.conv2.weight"].shape == (128, 128, 3, 3)
    assert state["layer4.0.downsample.0.weight"].shape == (2048, 1024, 1, 1)
    assert state["layer1.0.downsample.1.running_var"].shape == (256,)
    assert state["fc.weight"].shape == (1000, 2048)
    assert "layer1.1.downsample.0.weight" not in state


def test_the_stride_is_on_the_3x3_convolution():
    # v1.5: the first block of stages 2-4 strides in conv2 (and its shortcut), never in conv1.
    model = resnet50()
    for stage in (model.layer2, model.layer3, model.layer4):
        first = stage[0]
        assert first.conv1.stride == (1, 1) and first.conv2.stride == (2, 2)
        assert first.downsample[0].stride == (2, 2)
    assert model.layer1[0].conv2.stride == (1, 1)


def test_num_classes():
    model = resnet50(num_classes=10)
    assert model.fc.weight.shape == (10, 2048)
    assert sum(p.numel() for p in model.parameters()) == RESNET50_PARAMETERS - 990 * 2049
    assert [(k, tuple(v.shape)) for k, v in model.state_dict().items()] == expected_state_dict_shapes(10)


@pytest.mark.slow
@pytest.mark.parametrize("size", [224, 64, 32])
def test_output_shape_for_any_image_size(size):
    model = resnet50(num_classes=7).eval()
    with torch.no_grad():
        out = model(torch.randn(2, 3, size, size))
    assert out.shape == (2, 7)
    assert torch.isfinite(out).all()


def test_initialisation():
    torch.manual_seed(0)
    model = resnet50()
    # kaiming_normal_(fan_out, relu): std sqrt(2 / (out_channels * k * k)).
    weight = model.layer3[1].conv2.weight  # 256 x 256 x 3 x 3: enough samples for a tight estimate
    expected_std = math.sqrt(2 / (256 * 9))
    assert abs(weight.std().item() / expected_std - 1) < 0.02
    assert abs(weight.mean().item()) < 0.05 * expected_std
    for name, module in model.named_modules():
        if isinstance(module, nn.BatchNorm2d):
            assert torch.equal(module.weight, torch.ones_like(module.weight)), name
            assert torch.equal(module.bias, torch.zeros_like(module.bias)), name


def test_zero_init_residual():
    model = resnet50(zero_init_residual=True)
    for stage in (model.layer1, model.layer2, model.layer3, model.layer4):
        for block in stage:
            assert not block.bn3.weight.any()
            assert block.bn2.weight.all()


def test_norm_layer_group_norm():
    model = resnet50(num_classes=5, norm_layer=lambda channels: nn.GroupNorm(32, channels))
    assert not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    assert sum(isinstance(m, nn.GroupNorm) for m in model.modules()) == 53
    assert not any(k.endswith("running_mean") for k in model.state_dict())
    # GroupNorm does not depend on the batch: one sample in training mode is fine.
    out = model(torch.randn(1, 3, 32, 32))
    assert out.shape == (1, 5)
    out.sum().backward()
    assert model.conv1.weight.grad is not None


@pytest.mark.slow
def test_every_parameter_gets_a_gradient():
    model = resnet50(num_classes=3)
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None or not p.grad.any()]
    assert missing == []


def test_state_dict_interchangeable_with_torchvision():
    torchvision = pytest.importorskip("torchvision")
    theirs = torchvision.models.resnet50()
    ours = resnet50()
    their_state, our_state = theirs.state_dict(), ours.state_dict()
    assert [(k, v.shape) for k, v in our_state.items()] == [(k, v.shape) for k, v in their_state.items()]
    ours.load_state_dict(their_state, strict=True)
    theirs.load_state_dict(our_state, strict=True)
    ours.eval()
    theirs.eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert torch.allclose(ours(x), theirs(x), atol=1e-5)


# torchvision's counts, 1000 classes
@pytest.mark.slow
@pytest.mark.parametrize("arch,parameters", [("resnet18", 11_689_512), ("resnet34", 21_797_672), ("resnet50", RESNET50_PARAMETERS),
                                             ("resnet101", 44_549_160)])
def test_each_arch_has_torchvisions_parameter_count(arch, parameters):
    assert sum(p.numel() for p in ARCHS[arch]().parameters()) == parameters


def test_resnet18_is_basic_blocks_with_torchvisions_names():
    model = resnet18(num_classes=10, zero_init_residual=True)
    state = model.state_dict()
    assert state["layer1.0.conv1.weight"].shape == (64, 64, 3, 3) and "layer1.0.conv3.weight" not in state
    assert state["layer2.0.conv1.weight"].shape == (128, 64, 3, 3) and model.layer2[0].conv1.stride == (2, 2)
    assert state["layer2.0.downsample.0.weight"].shape == (128, 64, 1, 1) and "layer1.0.downsample.0.weight" not in state
    assert state["fc.weight"].shape == (10, 512)
    assert all(not block.bn2.weight.any() and block.bn1.weight.all() for stage in (model.layer1, model.layer4) for block in stage)
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_a_narrower_resnet_has_torchvisions_names_and_a_fraction_of_its_parameters(arch):
    wide, narrow = ARCHS[arch](num_classes=4), ARCHS[arch](num_classes=4, width=8)
    assert list(narrow.state_dict()) == list(wide.state_dict())  # the same layers, in the same order
    assert narrow.conv1.out_channels == 8 and narrow.fc.in_features == wide.fc.in_features // 8
    ratio = sum(p.numel() for p in narrow.parameters()) / sum(p.numel() for p in wide.parameters())
    assert 1 / 80 < ratio < 1 / 50, ratio  # about (8/64)^2: every convolution's in and out channels are an eighth
    assert narrow(torch.randn(2, 3, 32, 32)).shape == (2, 4)


def test_a_width_below_one_is_refused():
    with pytest.raises(ValueError, match="width of at least 1"):
        resnet18(width=0)
