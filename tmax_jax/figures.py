"""Figures drawn with matplotlib: the learning curve, horizontal bar charts, and their PNG / SVG output.

Every figure is a ``matplotlib.figure.Figure`` on its own Agg canvas: pyplot's global state and GUI
backends are never touched, so figures can be drawn from any thread of a headless trainer. matplotlib
is imported inside the functions, which keeps ``import tmax_jax`` (and the CLI's start) fast.
"""

from __future__ import annotations

import io
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

WIDTH_IN = 8.0  # every figure's width in inches; heights follow the content
LABEL_WRAP = 26  # characters per line of a bar label before it wraps
TRAIN_COLOR, HELDOUT_COLOR = "#4269d0", "#e4572e"
BAR_COLORS = ("#4269d0", "#efb118", "#ff725c", "#6cc5b0", "#3ca951", "#ff8ab7", "#a463f2", "#97bbf5")


def new_figure(height_in: float, width_in: float = WIDTH_IN) -> Figure:
    """A Figure with an Agg canvas and constrained layout (tick labels, titles and legends sized in)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width_in, height_in), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def learning_curve_figure(
    train: Sequence[tuple[int, float]],
    heldout: Sequence[tuple[int, float]],
    *,
    title: str,
) -> Figure:
    """Pass rate per RL step: the train rollouts' rate at every step (a thin line) and the held-out
    rate at the steps it was measured (large markers joined by a line, each labelled with its value).

    The x axis shows whole steps only; the legend sits below the axes, where it hides no data.
    """
    from matplotlib.ticker import MaxNLocator

    fig = new_figure(4.6)
    ax = fig.add_subplot()
    train, heldout = sorted(train), sorted(heldout)
    if train:
        xs, ys = zip(*train, strict=True)
        ax.plot(
            xs,
            ys,
            color=TRAIN_COLOR,
            lw=1.4,
            alpha=0.85,
            marker="." if len(train) <= 80 else None,
            zorder=4,  # thin, over the thick held-out line: both stay visible where they coincide
            label="train pass rate (each step's rollouts)",
        )
    if heldout:
        xs, ys = zip(*heldout, strict=True)
        ax.plot(xs, ys, color=HELDOUT_COLOR, lw=2.0, marker="o", ms=7, zorder=3, label="held-out pass rate")
        if len(heldout) <= 12:
            for x, y in heldout:
                ax.annotate(
                    f"{y:.2f}",
                    (x, y),
                    xytext=(0, 8),
                    textcoords="offset points",
                    ha="center",
                    fontsize=8,
                    color=HELDOUT_COLOR,
                )
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(-0.03, 1.1)
    ax.set_yticks([0, 0.25, 0.5, 0.75, 1.0])
    ax.set_xlabel("RL step")
    ax.set_ylabel("pass rate")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.spines[["top", "right"]].set_visible(False)
    if train or heldout:
        fig.legend(loc="outside lower center", ncols=2, frameon=False)
    return fig


def wrap_label(label: str, width: int = LABEL_WRAP) -> str:
    """``label`` on lines of at most ``width`` characters, broken after '-', '_', '/' or spaces where it
    can be (a category such as "software-engineering/build-systems" stays whole, over two lines)."""
    pieces = re.findall(r"[^\s\-_/]*[\s\-_/]?", label)
    lines, line = [], ""
    for piece in filter(None, pieces):
        if line and len(line) + len(piece.rstrip()) > width:
            lines.append(line.rstrip())
            line = ""
        while len(piece) > width:  # one unbreakable run longer than a line
            lines.append(piece[:width])
            piece = piece[width:]
        line += piece
    if line.strip() or not lines:
        lines.append(line.rstrip())
    return "\n".join(lines)


def bar_chart_figure(
    labels: Sequence[str],
    series: Mapping[str, Sequence[float | None]],
    *,
    title: str,
    xlabel: str = "",
    xmax: float | None = 1.0,
    value_format: str = "{:.3f}",
) -> Figure:
    """Horizontal grouped bars: one row per label (top to bottom, in order), one bar per series.

    Labels are wrapped (never cut) and each row is tall enough for its label's lines, so labels of any
    length neither overlap nor leave the figure. None draws no bar and writes "n/a". Each bar carries
    its value; ``xmax`` fixes the axis end (None: the largest value).
    """
    names = list(series)
    for name in names:
        if len(series[name]) != len(labels):
            raise ValueError(f"series {name!r} has {len(series[name])} values for {len(labels)} labels")
    wrapped = [wrap_label(str(label)) for label in labels]
    lines = max([w.count("\n") + 1 for w in wrapped] + [1])
    row_in = max(0.24 * len(names) + 0.16, 0.17 * lines + 0.14)
    legend_in = 0.35 if len(names) > 1 else 0.0
    fig = new_figure(1.15 + legend_in + row_in * max(len(labels), 1))
    ax = fig.add_subplot()
    values = [v for name in names for v in series[name] if v is not None]
    end = xmax if xmax is not None else max(values + [0.0]) or 1.0
    bar_h = 0.8 / max(len(names), 1)
    for si, name in enumerate(names):
        ys = [i - 0.4 + bar_h * (si + 0.5) for i in range(len(labels))]
        vals = series[name]
        bars = ax.barh(
            ys,
            [0.0 if v is None else v for v in vals],
            height=bar_h * 0.92,
            color=BAR_COLORS[si % len(BAR_COLORS)],
            label=name,
        )
        ax.bar_label(
            bars,
            labels=["n/a" if v is None else value_format.format(v) for v in vals],
            padding=3,
            fontsize=9,
            color="#333",
        )
    ax.set_yticks(range(len(labels)), wrapped)
    ax.set_ylim(len(labels) - 0.5, -0.5)  # the first label on top
    if xmax is not None:
        ax.set_xticks([xmax * i / 4 for i in range(5)])
    else:  # counts
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlim(0, end * 1.14)  # room for the value written after the longest bar
    ax.tick_params(axis="y", length=0)
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    ax.spines[["top", "right"]].set_visible(False)
    ax.set_title(title)
    if xlabel:
        ax.set_xlabel(xlabel)
    if len(names) > 1:
        fig.legend(loc="outside lower center", ncols=min(len(names), 4), frameon=False)
    return fig


def save_png(fig: Figure, path: str | Path, dpi: int = 150) -> Path:
    path = Path(path)
    fig.savefig(path, format="png", dpi=dpi, metadata={"Software": None})
    return path


def to_svg(fig: Figure, *, id_salt: str) -> str:
    """The figure as an inline ``<svg>`` element for an HTML page.

    Text stays text (searchable, drawn by the browser) and there is no date stamp, so the same figure
    and salt give the same string. The ids that elements refer to (clip paths, markers) are hashed
    with ``id_salt`` and every other id is dropped: several charts in one page share no id.
    """
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": id_salt}):
        fig.savefig(buf, format="svg", metadata={"Date": None})
    text = buf.getvalue()
    text = text[text.index("<svg") :].strip()
    text = re.sub(r"\s*<metadata>.*?</metadata>", "", text, flags=re.S)
    used = set(re.findall(r'(?:url\(#|href="#)([^)"]+)', text))
    return re.sub(r' id="([^"]+)"', lambda m: m.group(0) if m.group(1) in used else "", text)
