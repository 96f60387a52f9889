"""Draw chapter 7's concept figure: an MLP's two matrix products split over two ranks.

    python book/figures/make_tensor_parallel.py      # writes tensor_parallel.svg

Each rank is a row. A matrix is a box drawn to the shape it has on that rank; its colour is the
rank that holds that slice (grey: every rank holds all of it; striped: a partial sum). The
split follows ``tutorial_utils.parallel.tensor``: ``fc`` column-parallel, ``proj`` row-parallel,
Megatron's *f* before the pair and *g* after it.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, Rectangle  # noqa: E402

HERE = Path(__file__).parent
COLOURS = ["#4c72b0", "#dd8452"]  # rank 0, rank 1
WHOLE = "#8c8c8c"
ROW_H = 3.2  # vertical space per rank


def box(ax, x, y, w, h, colour, label, partial=False) -> None:
    """A matrix of w x h drawn at (x, y), its lower left corner."""
    ax.add_patch(Rectangle((x, y), w, h, color=colour, alpha=0.35 if partial else 0.85, lw=0,
                           hatch="///" if partial else None))
    ax.add_patch(Rectangle((x, y), w, h, fill=False, ec="black", lw=0.7))
    ax.text(x + w / 2, y + h / 2, label, ha="center", va="center", fontsize=6.5 if partial else 9,
            color="black" if partial else "white", fontweight="bold")


def arrow(ax, x0, x1, y) -> None:
    ax.add_patch(FancyArrowPatch((x0, y), (x1, y), arrowstyle="-|>", mutation_scale=12,
                                 color="black", lw=0.8))


def collective(ax, x, label, forward, backward) -> None:
    """A collective spanning both ranks' rows at x: what it does each way."""
    ax.add_patch(Rectangle((x - 0.12, 0.2), 0.24, 2 * ROW_H - 0.8, color="#f2e6a6", lw=0))
    ax.text(x, 2 * ROW_H - 0.2, label, ha="center", fontsize=12, style="italic")
    ax.text(x, -0.45, f"forward: {forward}\nbackward: {backward}", ha="center", va="top",
            fontsize=7.5)


# Drawn to scale for h' = 4h: h is 0.5 wide, h'/2 is 1.0, the tokens 1.6 tall.
H_, HALF, TOKENS = 0.5, 1.0, 1.6
X_AT = {"X": 0.0, "f": 0.85, "A": 1.3, "Y": 2.6, "B": 3.9, "YB": 4.7, "g": 5.55, "Z": 6.0}


def rank_row(ax, r: int) -> None:
    y = (1 - r) * ROW_H + 0.4  # rank 0 on top
    mid, c, x = y + TOKENS / 2, COLOURS[r], X_AT
    ax.text(-0.2, mid, f"rank {r}", ha="right", va="center", fontsize=9)
    box(ax, x["X"], y, H_, TOKENS, WHOLE, "X")  # tokens x h: every rank has all of it
    arrow(ax, x["X"] + H_ + 0.05, x["A"] - 0.05, mid)
    box(ax, x["A"], mid - H_ / 2, HALF, H_, c, f"A{r}")  # h x h'/2: its columns of fc
    ax.text(x["A"] + HALF / 2, mid + H_ / 2 + 0.1, "fc", ha="center", fontsize=7.5,
            family="monospace")
    arrow(ax, x["A"] + HALF + 0.05, x["Y"] - 0.05, mid)
    box(ax, x["Y"], y, HALF, TOKENS, c, f"Y{r}")  # tokens x h'/2, GeLU on it alone
    ax.text(x["Y"] + HALF / 2, y + TOKENS + 0.1, "GeLU", ha="center", fontsize=7.5)
    arrow(ax, x["Y"] + HALF + 0.05, x["B"] - 0.05, mid)
    box(ax, x["B"], mid - HALF / 2, H_, HALF, c, f"B{r}")  # h'/2 x h: its rows of proj
    ax.text(x["B"] + H_ / 2, mid + HALF / 2 + 0.1, "proj", ha="center", fontsize=7.5,
            family="monospace")
    arrow(ax, x["B"] + H_ + 0.05, x["YB"] - 0.05, mid)
    box(ax, x["YB"], y, H_, TOKENS, c, f"Y{r}B{r}", partial=True)  # a summand of Z
    arrow(ax, x["YB"] + H_ + 0.05, x["Z"] - 0.05, mid)
    box(ax, x["Z"], y, H_, TOKENS, WHOLE, "Z")


def tensor_parallel_figure():
    fig, ax = plt.subplots(figsize=(7.5, 4.4))
    for r in (0, 1):
        rank_row(ax, r)
    collective(ax, X_AT["f"], "f", "nothing", "all-reduce dX")
    collective(ax, X_AT["g"], "g", "all-reduce Z", "nothing")
    ax.text(3.2, 2 * ROW_H - 0.2, "no communication inside the pair", ha="center", fontsize=8.5)
    ax.set(xlim=(-1.0, 6.8), ylim=(-1.3, 2 * ROW_H + 0.2), aspect="equal")
    ax.axis("off")
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    plt.rcParams["svg.hashsalt"] = "tutorial_utils"  # the same ids on every run: stable diffs
    fig = tensor_parallel_figure()
    fig.savefig(HERE / "tensor_parallel.svg", metadata={"Date": None}, bbox_inches="tight")
    print(f"wrote {HERE / 'tensor_parallel.svg'}")
