"""The matplotlib figures, read back from the drawn Agg canvas: whole-step ticks, held-out points at the
steps they were measured, a legend off the data, and bar labels that are neither cut nor overlapping."""

import itertools
import re

import pytest

from tmax_jax.figures import bar_chart_figure, learning_curve_figure, save_png, to_svg, wrap_label

LONG_CATEGORIES = [
    "files",
    "software-engineering",
    "system-administration/networking-and-firewalls",
    "data_processing_pipelines_and_extract_transform_load",
    "a category name with several words in it",
    "x" * 60,  # no place to break at all
]


def _visible_ticks(ax):
    lo, hi = sorted(ax.get_xlim())
    return [t for t in ax.get_xticklabels() if lo <= t.get_position()[0] <= hi]


def _line(ax, label):
    (line,) = [ln for ln in ax.get_lines() if ln.get_label() == label]
    return line


@pytest.mark.parametrize(
    "steps, heldout_steps",
    [(3, [0, 3]), (7, [0, 2, 4, 6, 7]), (250, [0, 50, 100, 150, 200, 250])],
)
def test_learning_curve_ticks_are_whole_steps_and_heldout_sits_at_its_steps(steps, heldout_steps):
    train = [(s, (s % 5) / 5) for s in range(1, steps + 1)]
    heldout = [(s, 0.1 + 0.8 * s / steps) for s in heldout_steps]
    fig = learning_curve_figure(list(reversed(train)), heldout, title="curve")
    fig.canvas.draw()
    (ax,) = fig.axes
    ticks = _visible_ticks(ax)
    assert len(ticks) >= 2
    for t in ticks:
        # The label reads as a whole number (matplotlib writes the minus sign as U+2212).
        assert re.fullmatch(r"\u2212?\d+", t.get_text()), t.get_text()
        assert float(t.get_text().replace("\u2212", "-")) == t.get_position()[0]
    held = _line(ax, "held-out pass rate")
    assert held.get_xydata().tolist() == [[float(x), y] for x, y in heldout]
    assert held.get_marker() == "o"
    assert _line(ax, "train pass rate (each step's rollouts)").get_xydata().tolist() == [
        [float(x), y] for x, y in train
    ]
    # Both series stay inside the y range, and the legend sits outside the axes (it hides no data).
    lo, hi = ax.get_ylim()
    assert lo < 0.0 and hi > 1.0
    (legend,) = fig.legends
    assert not legend.get_window_extent().overlaps(ax.get_window_extent())
    assert [t.get_text() for t in legend.get_texts()] == [
        "train pass rate (each step's rollouts)",
        "held-out pass rate",
    ]


def test_learning_curve_png_is_written(tmp_path):
    from PIL import Image

    path = save_png(learning_curve_figure([(1, 0.5)], [(0, 0.0), (1, 1.0)], title="t"), tmp_path / "c.png")
    with Image.open(path) as im:
        assert im.format == "PNG" and im.size == (1200, 690)  # 8 x 4.6 inches at 150 dpi


@pytest.mark.parametrize("n_series", [1, 2, 3])
def test_bar_labels_are_whole_inside_the_figure_and_do_not_overlap(n_series):
    names = [f"pass@{j}" for j in (1, 2, 4)[:n_series]]
    series = {n: [(i % 4) / 4 for i in range(len(LONG_CATEGORIES))] for n in names}
    fig = bar_chart_figure(LONG_CATEGORIES, series, title="per category")
    fig.canvas.draw()
    (ax,) = fig.axes
    renderer = fig.canvas.get_renderer()
    figure_box = fig.bbox
    labels = ax.get_yticklabels()
    # Every label is the whole category (wrapped over lines, never shortened), in order, top to bottom.
    assert ["".join(t.get_text().split()) for t in labels] == ["".join(c.split()) for c in LONG_CATEGORIES]
    assert all("…" not in t.get_text() for t in labels)
    boxes = [t.get_window_extent(renderer) for t in labels]
    for t, box in zip(labels, boxes):
        assert max(len(line) for line in t.get_text().split("\n")) <= 26
        assert figure_box.x0 <= box.x0 and box.x1 <= figure_box.x1, t.get_text()
        assert figure_box.y0 <= box.y0 and box.y1 <= figure_box.y1, t.get_text()
    for a, b in itertools.combinations(boxes, 2):
        assert not a.overlaps(b)
    assert [b.y0 for b in boxes] == sorted((b.y0 for b in boxes), reverse=True)
    # The title is inside the figure too, and the bars are the values given.
    assert ax.title.get_window_extent(renderer).y1 <= figure_box.y1
    for container, name in zip(ax.containers, names):
        assert [p.get_width() for p in container] == series[name]


def test_missing_values_draw_no_bar_and_say_na():
    fig = bar_chart_figure(["a", "b"], {"pass@1": [0.5, None]}, title="t")
    (ax,) = fig.axes
    assert [p.get_width() for p in ax.containers[0]] == [0.5, 0.0]
    assert [t.get_text() for t in ax.texts] == ["0.500", "n/a"]
    with pytest.raises(ValueError, match="has 1 values for 2 labels"):
        bar_chart_figure(["a", "b"], {"pass@1": [0.5]}, title="t")


def test_count_bars_have_integer_ticks():
    fig = bar_chart_figure(["x", "y"], {"tasks": [7, 3]}, title="t", xmax=None, value_format="{:d}")
    fig.canvas.draw()
    (ax,) = fig.axes
    assert [t.get_text() for t in ax.texts] == ["7", "3"]
    for t in _visible_ticks(ax):
        assert re.fullmatch(r"\d+", t.get_text()), t.get_text()


def test_wrap_label_keeps_every_character():
    for label in LONG_CATEGORIES:
        wrapped = wrap_label(label)
        assert "".join(wrapped.split()) == "".join(label.split())
        assert all(len(line) <= 26 for line in wrapped.split("\n"))
    assert wrap_label("software-engineering/build-systems") == "software-engineering/\nbuild-systems"
    assert (
        wrap_label("a category name with several words in it") == "a category name with\nseveral words in it"
    )
    assert wrap_label("x" * 60) == "\n".join(["x" * 26, "x" * 26, "x" * 8])
    assert wrap_label("short") == "short"


def test_svg_is_inline_escaped_deterministic_and_ids_do_not_collide():
    def svg(title, salt):
        return to_svg(bar_chart_figure(["<b>&", "ok"], {"v": [0.25, 1.0]}, title=title), id_salt=salt)

    one = svg("first", "first")
    assert one.startswith("<svg") and one.endswith("</svg>")
    assert "&lt;b&gt;&amp;" in one and "<b>" not in one
    assert ">first</text>" in one  # text stays text: searchable, drawn by the browser
    assert one == svg("first", "first")
    ids = lambda s: re.findall(r'id="([^"]+)"', s)  # noqa: E731
    refs = lambda s: set(re.findall(r'(?:url\(#|href="#)([^)"]+)', s))  # noqa: E731
    two = svg("second", "second")
    # Every id left is referred to within its own chart, and no id appears in both charts.
    assert ids(one) and set(ids(one)) == refs(one) and set(ids(two)) == refs(two)
    assert len(ids(one)) == len(set(ids(one))) and not set(ids(one)) & set(ids(two))
