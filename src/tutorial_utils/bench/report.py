"""What every benchmark does with its results: a table, a figure title and legend, glue.

Each chapter's benchmark module measures; this module only presents. :func:`table` is the one
table builder (fixed-width text from rows and :class:`Column` specs). A benchmark's
``summary()`` returns a flat ``{name: number or text}`` dict, and a notebook hands it to
:func:`glue_summary` in one call, so the prose can quote every value with ``{glue:text}``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Column:
    key: str
    header: str
    fmt: str = ""  # a format spec such as ".2f", or "" for str()
    width: int = 10
    left: bool = False
    unit: str = ""  # written after each value, such as "x" for a ratio
    missing: str = "-"  # written where a row has no value


def cell(value: object, col: Column) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        text = col.missing
    else:
        text = (format(value, col.fmt) if col.fmt else str(value)) + col.unit
    return f"{text:<{col.width}}" if col.left else f"{text:>{col.width}}"


def table(rows: Iterable[Mapping[str, object]], columns: Sequence[Column]) -> str:
    """Fixed-width text table, one line per row; missing values print as ``-``."""
    head = "".join(f"{c.header:<{c.width}}" if c.left else f"{c.header:>{c.width}}"
                   for c in columns)
    lines = [head] + ["".join(cell(row.get(c.key), c) for c in columns) for row in rows]
    return "\n".join(line.rstrip() for line in lines)


def figure_title(what: str, gpus: int | None = None) -> str:
    """``what`` followed by the hardware it was measured on (``2 x NVIDIA H200``); ``gpus``
    names how many of the machine's GPUs the figure's runs used (``1 x NVIDIA H200``)."""
    from ..stamp import environment_stamp

    stamp = environment_stamp()
    if gpus is None or not stamp.is_gpu:
        return f"{what} - {stamp.hardware}"
    if gpus > stamp.gpu_count:
        raise ValueError(f"the figure's runs cannot have used {gpus} GPUs: this machine has "
                         f"{stamp.gpu_count}")
    return f"{what} - {gpus} x {stamp.gpu_names[0]}"


def legend_outside(ax, where: str = "right", fontsize: int = 8, ncol: int = 1) -> None:
    """The axes' legend beside them (``"right"``) or under them (``"below"``): outside the
    data, so that it hides no bar or point whatever the numbers turn out to be."""
    if where == "right":
        ax.legend(fontsize=fontsize, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    elif where == "below":
        from matplotlib.transforms import ScaledTranslation

        # Half an inch under the axes: below the tick labels and the axis label.
        under = ax.transAxes + ScaledTranslation(0, -0.5, ax.figure.dpi_scale_trans)
        ax.legend(fontsize=fontsize, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=ncol,
                  bbox_transform=under, frameon=False)
    else:
        raise ValueError(f"where must be 'right' or 'below', not {where!r}")


def glue_summary(summary: Mapping[str, object], prefix: str = "") -> None:
    """Glue every value of a flat summary under ``prefix + key`` for ``{glue:text}``."""
    from myst_nb import glue

    for key, value in summary.items():
        glue(prefix + key, value, display=False)
