import pytest
import torch
import torch.nn.functional as F

from tutorial_utils.models import WideResNet, wide_resnet
from tutorial_utils.models.ghost_norm import GhostBatchNorm2d, convert_ghost_batchnorm


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
    with pytest.raises(ValueError, match="must look like 'wrn-28-10'"):
        wide_resnet("resnet50")


def test_ghost_batchnorm_normalises_each_group_by_itself():
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm2d(4)
    torch.nn.init.normal_(bn.weight)
    torch.nn.init.normal_(bn.bias)
    ghost = convert_ghost_batchnorm(torch.nn.Sequential(bn), 3)[0]
    assert isinstance(ghost, GhostBatchNorm2d) and torch.equal(ghost.weight, bn.weight)
    x = torch.randn(6, 4, 5, 5) * 3 + 1
    out = ghost(x)
    groups = (slice(0, 3), slice(3, 6))
    for g in groups:  # each group normalised as a batch of its own by plain BatchNorm
        ref = F.batch_norm(x[g], None, None, bn.weight, bn.bias, training=True, eps=bn.eps)
        torch.testing.assert_close(out[g], ref)
    # the running statistics move towards the groups' mean statistics, unbiased variance
    means = torch.stack([x[g].mean(dim=(0, 2, 3)) for g in groups]).mean(0)
    variances = torch.stack([x[g].var(dim=(0, 2, 3)) for g in groups]).mean(0)
    torch.testing.assert_close(ghost.running_mean, 0.1 * means)
    torch.testing.assert_close(ghost.running_var, 0.9 + 0.1 * variances)
    out.sum().backward()
    assert ghost.weight.grad is not None
    ghost.eval()
    bn.load_state_dict(ghost.state_dict())
    bn.eval()
    torch.testing.assert_close(ghost(x), bn(x))  # evaluation: BatchNorm with those statistics


def test_ghost_batchnorm_of_one_group_is_batchnorm_and_rejects_ragged_batches():
    bn, x = torch.nn.BatchNorm2d(4), torch.randn(8, 4, 3, 3)
    ghost = GhostBatchNorm2d(4, 8)
    torch.testing.assert_close(ghost(x), bn(x))
    torch.testing.assert_close(ghost.running_var, bn.running_var)
    with pytest.raises(ValueError, match="batch of 6 does not split into ghost batches of 4"):
        GhostBatchNorm2d(4, 4)(torch.randn(6, 4, 3, 3))
    with pytest.raises(ValueError, match="at least 2 images"):
        GhostBatchNorm2d(4, 1)
    with pytest.raises(ValueError, match="needs a momentum, a scale and shift"):
        convert_ghost_batchnorm(torch.nn.BatchNorm2d(4, affine=False), 2)


def test_converted_wrn_has_no_plain_batchnorm_left_and_trains():
    model = convert_ghost_batchnorm(WideResNet(depth=10, width=1), 2)
    norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert len(norms) == 7 and all(isinstance(m, GhostBatchNorm2d) for m in norms)
    model(torch.randn(4, 3, 32, 32)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
