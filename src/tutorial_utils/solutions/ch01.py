"""Solutions to the exercises of chapter 1, "The toy network on the CPU"."""

from __future__ import annotations

import torch

from ..toy import toy_grad_output, toy_input, toy_model, toy_output_shape


def larger_input_shapes(shape: tuple[int, ...] = (16, 3, 32, 32)) -> tuple[tuple, tuple]:
    """Exercise 1: the output shape predicted for a larger input, and the one the toy gives."""
    predicted = toy_output_shape(shape)
    measured = tuple(toy_model()(torch.zeros(shape)).shape)
    return predicted, measured


def accumulation_matches_doubling(seed: int = 0) -> bool:
    """Exercise 2: two backward passes with ``g`` leave the same ``.grad`` as one with ``2 g``."""
    gen = torch.Generator().manual_seed(seed)
    model, x = toy_model(), toy_input(gen)
    g = toy_grad_output(torch.Size(toy_output_shape()), gen)
    model(x).backward(g)
    model(x).backward(g)
    twice = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).backward(2 * g)
    return all(torch.allclose(a, p.grad) for a, p in zip(twice, model.parameters(), strict=True))
