"""A PNG line chart of the learning curve, drawn with Pillow (no plotting library needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from PIL import Image, ImageDraw

_COLORS = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40))


def line_chart(
    path: str | Path,
    series: dict[str, Sequence[tuple[float, float]]],
    *,
    title: str,
    xlabel: str = "step",
    ylim: tuple[float, float] = (0.0, 1.0),
    size: tuple[int, int] = (720, 420),
) -> Path:
    W, H = size
    left, right, top, bottom = 60, 20, 40, 50
    img = Image.new("RGB", size, "white")
    d = ImageDraw.Draw(img)
    d.text((left, 12), title, fill="black")
    xs = [x for pts in series.values() for x, _ in pts] or [0.0, 1.0]
    x0, x1 = min(xs), max(xs)
    if x1 == x0:
        x1 = x0 + 1
    y0, y1 = ylim

    def px(x: float, y: float) -> tuple[float, float]:
        return (
            left + (x - x0) / (x1 - x0) * (W - left - right),
            H - bottom - (min(max(y, y0), y1) - y0) / (y1 - y0) * (H - top - bottom),
        )

    d.rectangle([left, top, W - right, H - bottom], outline="black")
    for i in range(6):
        y = y0 + (y1 - y0) * i / 5
        _, yy = px(x0, y)
        d.line([left - 4, yy, W - right, yy], fill=(225, 225, 225))
        d.text((8, yy - 6), f"{y:.2f}", fill="black")
    for i in range(6):
        x = x0 + (x1 - x0) * i / 5
        xx, _ = px(x, y0)
        d.text((xx - 8, H - bottom + 6), f"{x:g}", fill="black")
    d.text((W // 2 - 10, H - 22), xlabel, fill="black")
    for k, (name, pts) in enumerate(series.items()):
        color = _COLORS[k % len(_COLORS)]
        pts = sorted(pts)
        if len(pts) > 1:
            d.line([px(x, y) for x, y in pts], fill=color, width=2)
        for x, y in pts:
            cx, cy = px(x, y)
            d.ellipse([cx - 3, cy - 3, cx + 3, cy + 3], fill=color)
        d.text((W - right - 180, top + 8 + 14 * k), f"-- {name}", fill=color)
    path = Path(path)
    img.save(path)
    return path
