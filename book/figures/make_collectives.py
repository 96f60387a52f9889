"""Draw chapter 3b's concept figures: what each collective does, and the ring all-reduce.

    python book/figures/make_collectives.py      # writes collectives.svg and ring_all_reduce.svg

Each rank's buffer is a row of chunks; a chunk's colours are the ranks whose data it holds
(several colours: a sum). The ring figure is simulated with the same chunk indices as
``tutorial_utils.parallel.collectives.ring_all_reduce``.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, Rectangle  # noqa: E402

HERE = Path(__file__).parent
COLOURS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52"]  # rank 0, 1, 2, 3
LETTERS = "abcd"
W, H, GAP = 1.0, 0.8, 0.25  # a chunk's width and height, the space between ranks' rows


def chunk(ax, x: float, y: float, owners: frozenset[int], label: str = "", bold=False) -> None:
    """One chunk at (x, y): one vertical stripe per rank whose data it holds; empty if none."""
    if not owners:
        ax.add_patch(Rectangle((x, y), W, H, fill=False, ls=":", ec="grey"))
        return
    stripe = W / len(owners)
    for i, r in enumerate(sorted(owners)):
        ax.add_patch(Rectangle((x + i * stripe, y), stripe, H, color=COLOURS[r], lw=0))
    ax.add_patch(Rectangle((x, y), W, H, fill=False, ec="black", lw=2.2 if bold else 0.6))
    ax.text(x + W / 2, y + H / 2, label, ha="center", va="center", fontsize=8, color="white",
            fontweight="bold")


def label_of(owners: frozenset[int], k: int, n: int) -> str:
    if len(owners) == n:
        return f"Σ{k}"
    return "+".join(f"{LETTERS[r]}{k}" for r in sorted(owners))


def buffers(ax, x0: float, state: list[list[frozenset[int]]], bold=frozenset()) -> None:
    """Rank r's chunks in row r (rank 0 on top), starting at x0."""
    n = len(state)
    for r, row in enumerate(state):
        y = (n - 1 - r) * (H + GAP)
        for k, owners in enumerate(row):
            chunk(ax, x0 + k * W, y, owners, label_of(owners, k, n), (r, k) in bold)


def collectives_figure(n: int = 4):
    everyone = frozenset(range(n))
    own = [[frozenset({r})] * n for r in range(n)]
    empty = frozenset()
    cases = [
        ("broadcast: dist.broadcast(t, src=0)",
         [own[0]] + [[empty] * n for _ in range(1, n)], [own[0]] * n),
        ("reduce-scatter: dist.reduce_scatter_tensor(out, t)",
         own, [[everyone if k == r else empty for k in range(n)] for r in range(n)]),
        ("all-gather: dist.all_gather_into_tensor(t, part)",
         [[frozenset({r}) if k == r else empty for k in range(n)] for r in range(n)],
         [[frozenset({k}) for k in range(n)]] * n),
        ("all-reduce: dist.all_reduce(t)", own, [[everyone] * n] * n),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(10, 5.2))
    for ax, (title, before, after) in zip(axes.flat, cases, strict=True):
        buffers(ax, 1.0, before)
        buffers(ax, 2.0 + n * W + 1.0, after)
        middle = (n * (H + GAP) - GAP) / 2
        ax.add_patch(FancyArrowPatch((1.2 + n * W, middle), (1.8 + n * W + 1.0, middle),
                                     arrowstyle="-|>", mutation_scale=18, color="black"))
        for r in range(n):
            ax.text(0.9, (n - 1 - r) * (H + GAP) + H / 2, f"rank {r}", ha="right", va="center",
                    fontsize=8)
        ax.text(1.0 + n * W / 2, n * (H + GAP), "before", ha="center", fontsize=8)
        ax.text(3.0 + 1.5 * n * W, n * (H + GAP), "after", ha="center", fontsize=8)
        ax.set_title(title, fontsize=9, family="monospace")
        ax.set_xlim(-0.6, 3.2 + 2 * n * W)
        ax.set_ylim(-0.2, n * (H + GAP) + 0.3)
        ax.set_axis_off()
    fig.tight_layout()
    return fig


def ring_states(n: int) -> list[tuple[str, list[list[frozenset[int]]], set]]:
    """The buffers after each step of ``ring_all_reduce``, and the chunks received in it."""
    state = [[frozenset({r}) for _ in range(n)] for r in range(n)]
    states = [("start", [row[:] for row in state], set())]
    for phase in ("reduce-scatter", "all-gather"):
        for step in range(n - 1):
            new, got = [row[:] for row in state], set()
            for r in range(n):  # rank r sends to r + 1: the same indices as the package's code
                k = (r - step) % n if phase == "reduce-scatter" else (r + 1 - step) % n
                q = (r + 1) % n
                new[q][k] = state[q][k] | state[r][k] if phase == "reduce-scatter" else state[r][k]
                got.add((q, k))
            state = new
            states.append((f"{phase}\nstep {step + 1} of {n - 1}", [row[:] for row in state], got))
    return states


def ring_figure(n: int = 3):
    states = ring_states(n)
    width = n * W + 0.8
    fig, ax = plt.subplots(figsize=(10, 2.9))
    for i, (title, state, got) in enumerate(states):
        x0 = 1.0 + i * width
        buffers(ax, x0, state, bold=got)
        ax.text(x0 + n * W / 2, n * (H + GAP) + 0.05, title, ha="center", va="bottom", fontsize=8)
    for r in range(n):
        ax.text(0.9, (n - 1 - r) * (H + GAP) + H / 2, f"rank {r}", ha="right", va="center",
                fontsize=8)
    ax.set_xlim(-0.4, 1.0 + len(states) * width)
    ax.set_ylim(-0.2, n * (H + GAP) + 0.8)
    ax.set_axis_off()
    fig.tight_layout()
    return fig


def main() -> None:
    plt.rcParams["svg.hashsalt"] = "tutorial_utils"  # the same ids on every run: stable diffs
    for name, fig in (("collectives", collectives_figure()), ("ring_all_reduce", ring_figure())):
        fig.savefig(HERE / f"{name}.svg", metadata={"Date": None}, bbox_inches="tight")
        plt.close(fig)
        print(f"wrote {HERE / name}.svg")


if __name__ == "__main__":
    main()
