import pytest
import torch

from tutorial_utils.models.wrn import WideResNet, wide_resnet


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


@pytest.mark.parametrize("momentum", [0.1, None])  # None: the running mean of all batches
def test_ghost_batchnorm_normalises_each_group_by_its_own_statistics(momentum):
    from torch import nn

    from tutorial_utils.models.ghost_bn import GhostBatchNorm2d

    torch.manual_seed(0)
    x = torch.randn(16, 8, 5, 5).to(memory_format=torch.channels_last) * 3 + 1
    ghost, plain = GhostBatchNorm2d(8, 4, momentum=momentum), nn.BatchNorm2d(8, momentum=momentum)
    with torch.no_grad():
        ghost.weight.uniform_(), ghost.bias.uniform_()
        plain.load_state_dict(ghost.state_dict(), strict=False)
    groups = [x[i:i + 4] for i in range(0, 16, 4)]
    expected = torch.cat([nn.functional.batch_norm(
        g, None, None, ghost.weight, ghost.bias, training=True) for g in groups])
    torch.testing.assert_close(ghost(x), expected, atol=1e-5, rtol=1e-5)
    whole = nn.functional.batch_norm(x, None, None, ghost.weight, ghost.bias, training=True)
    assert not torch.allclose(expected, whole, atol=1e-3)  # not the whole batch's statistics
    for step in range(2):  # the running statistics: the first group's, as nn.BatchNorm2d keeps them
        plain(groups[0] + step)
        if step:
            ghost(x + step)
    torch.testing.assert_close(ghost.running_mean, plain.running_mean)
    torch.testing.assert_close(ghost.running_var, plain.running_var)
    ghost.eval(), plain.eval()
    torch.testing.assert_close(ghost(x), plain(x))  # evaluation: the running statistics


def test_ghost_batchnorm_keeps_the_weights_and_refuses_a_batch_it_cannot_split():
    from tutorial_utils.models.ghost_bn import GhostBatchNorm2d, ghost_batchnorm

    net = WideResNet(depth=10, width=1)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    ghost_batchnorm(net, 4)
    kinds = [type(m) for m in net.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert kinds and set(kinds) == {GhostBatchNorm2d}
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    with pytest.raises(ValueError, match="a batch of 6 images does not split into groups of 4"):
        net(torch.randn(6, 3, 32, 32))
    with pytest.raises(ValueError, match="at least two images"):
        GhostBatchNorm2d(8, 1)


def test_ghost_batchnorm_keeps_the_dtype_and_layout_of_its_input():
    from tutorial_utils.models.ghost_bn import GhostBatchNorm2d

    ghost = GhostBatchNorm2d(8, 4)
    x = torch.randn(16, 8, 5, 5).to(memory_format=torch.channels_last)
    assert ghost(x).is_contiguous(memory_format=torch.channels_last)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = torch.nn.functional.conv2d(x, torch.randn(8, 8, 1, 1))  # bf16 under autocast
        assert ghost(h).dtype == torch.nn.BatchNorm2d(8)(h).dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_ghost_batchnorm_of_a_converted_batchnorm_in_another_dtype(dtype):
    # a network moved to float64 or bfloat16 keeps its BatchNorm in that dtype, a root
    # BatchNorm included; its running statistics stay in it too
    from tutorial_utils.models.ghost_bn import GhostBatchNorm2d, ghost_batchnorm

    ghost = ghost_batchnorm(torch.nn.BatchNorm2d(8).to(dtype), 4)
    assert type(ghost) is GhostBatchNorm2d and ghost.weight.dtype == dtype
    x = torch.randn(16, 8, 5, 5, dtype=dtype)
    y = ghost(x)
    assert y.dtype == dtype and ghost.running_mean.dtype == ghost.running_var.dtype == dtype
    first = x[:4].double()  # the first group: its normalisation, and the running statistics
    expected = torch.nn.functional.batch_norm(first, None, None, training=True)
    tol = 1e-9 if dtype == torch.float64 else 2e-2
    torch.testing.assert_close(y[:4].double(), expected, atol=tol, rtol=tol)
    # one step of momentum 0.1 from (0, 1) towards the first group's statistics
    assert ghost.running_mean.double().sub(0.1 * first.mean((0, 2, 3))).abs().max() < tol
    var = first.var((0, 2, 3), correction=1)
    assert ghost.running_var.double().sub(0.9 + 0.1 * var).abs().max() < tol


def test_ghost_batchnorm_without_running_statistics_groups_in_evaluation_too():
    from tutorial_utils.models.ghost_bn import GhostBatchNorm2d

    ghost = GhostBatchNorm2d(8, 4, track_running_stats=False).eval()
    offsets = torch.arange(4.0).repeat_interleave(4).view(16, 1, 1, 1)  # each group its own
    x = torch.randn(16, 8, 5, 5) * (2 + offsets) + 3 * offsets
    groups = torch.cat([torch.nn.functional.batch_norm(x[i:i + 4], None, None, ghost.weight,
                                                       ghost.bias, training=True)
                        for i in range(0, 16, 4)])
    torch.testing.assert_close(ghost(x), groups, atol=1e-5, rtol=1e-5)


def test_the_trainer_normalises_over_groups_with_ghost_bn():
    from tutorial_utils.data import synthetic_cifar10
    from tutorial_utils.models.ghost_bn import GhostBatchNorm2d
    from tutorial_utils.parallel.distributed import DistContext
    from tutorial_utils.trainer import TrainConfig, Trainer

    cfg = TrainConfig(depth=10, width=1, batch=32, ghost_bn=4, device="cpu", precision="fp32",
                      checkpoint_every=0)
    cpu = DistContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    trainer = Trainer(cfg, cpu, synthetic_cifar10(256, 64))
    norms = [m for m in trainer.net.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert norms and all(type(m) is GhostBatchNorm2d and m.group == 4 for m in norms)
    trainer.train_one_epoch(0)
    assert all(int(m.num_batches_tracked) == trainer.steps_per_epoch for m in norms)
