"""The GPT's training loop on one device: the program the next three versions change.

    python -m tutorial_utils.workers.loop_one_device --steps 100

Chapter 7 shows this file whole, then each of ``loop_ddp.py``, ``loop_fsdp2.py`` and
``loop_fsdp2_tp.py`` as its difference from the one before. Every version trains the same GPT
on the same batches of Python's own source, one global batch a step, so each prints the losses
this one prints, up to float rounding.
"""

import argparse
import json
from pathlib import Path

import torch

from tutorial_utils.models.gpt import GPT, GPTConfig, lm_loss
from tutorial_utils.text import batch, stdlib_corpus


def setup() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def build(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial weights in every version
    cfg = GPTConfig(dim=args.dim, layers=args.layers, heads=args.heads, seq=args.seq)
    return GPT(cfg).to(device)


def train(args: argparse.Namespace, device: torch.device) -> list[float]:
    model = build(args, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    text, g = stdlib_corpus(max_bytes=2_000_000).train, torch.Generator().manual_seed(0)
    losses = []
    for _ in range(args.steps):
        x, y = batch(text, args.batch, args.seq, g, device)  # one global batch
        loss = lm_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=8, help="sequences per step, in all")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--out", type=Path, default=None, help="write the losses here (JSON)")
    args = parser.parse_args()
    device = setup()
    losses = train(args, device)
    print(f"loss {losses[0]:.4f} at the first step, {losses[-1]:.4f} at step {args.steps}")
    if args.out:
        args.out.write_text(json.dumps({"world_size": 1, "losses": losses}))


if __name__ == "__main__":
    main()
