import pytest
import torch

from tutorial_utils.models import WideResNet, wide_resnet


def n_params(model):
    return sum(p.numel() for p in model.parameters())


def test_wrn_28_10_has_the_published_parameter_count():
    with torch.device("meta"):
        assert n_params(wide_resnet("wrn-28-10")) == 36_479_194


def test_forward_shape_and_backward():
    model = WideResNet(depth=10, width=1)
    out = model(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 10)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"depth": 27}, "depth must be 6n\\+4"),
        ({"depth": 4}, "depth must be 6n\\+4"),
        ({"width": 0}, "width factor must be >= 1"),
        ({"dropout": 1.0}, "dropout must be in"),
    ],
)
def test_bad_shapes_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        WideResNet(**kwargs)


def test_bad_name():
    with pytest.raises(ValueError, match="looks like 'wrn-28-10'"):
        wide_resnet("resnet50")
