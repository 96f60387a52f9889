"""Parallel training strategies, each a hand-written mechanism beside the PyTorch wrapper."""
