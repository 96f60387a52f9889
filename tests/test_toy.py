import torch

from tutorial_utils.toy import INPUT_SHAPE, toy_grad_output, toy_input, toy_model, toy_output_shape


def test_input_is_integers_in_byte_range():
    x = toy_input(torch.Generator().manual_seed(0))
    assert x.shape == INPUT_SHAPE and x.dtype == torch.float32
    assert x.min() >= 0 and x.max() <= 255 and torch.equal(x, x.round())


def test_output_shape_matches_unpadded_convolutions():
    model = toy_model()
    assert model(toy_input()).shape == toy_output_shape() == (16, 3, 2, 6)


def test_explicit_output_gradient_equals_gradient_of_weighted_sum():
    torch.manual_seed(0)
    model = toy_model()
    x = toy_input()
    y = model(x)
    g = toy_grad_output(y.shape)
    assert g.abs().max() <= 0.1
    y.backward(g)
    explicit = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    (model(x) * g).sum().backward()
    for a, p in zip(explicit, model.parameters(), strict=True):
        torch.testing.assert_close(a, p.grad)
