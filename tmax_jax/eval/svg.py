"""Grouped bar charts as inline SVG, so the HTML report needs no plotting library."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from html import escape

PALETTE = ("#4269d0", "#efb118", "#ff725c", "#6cc5b0", "#3ca951", "#ff8ab7", "#a463f2", "#97bbf5")


def bar_chart(
    labels: Sequence[str],
    series: Mapping[str, Sequence[float | None]],
    *,
    title: str,
    y_max: float = 1.0,
    y_label: str = "",
    width: int = 720,
    height: int = 300,
) -> str:
    """One group of bars per label, one bar per series; None values draw no bar (shown as n/a)."""
    names = list(series)
    for name in names:
        if len(series[name]) != len(labels):
            raise ValueError(f"series {name!r} has {len(series[name])} values for {len(labels)} labels")
    left, right, top, bottom = 48, 12, 28, 64
    plot_w, plot_h = width - left - right, height - top - bottom
    group_w = plot_w / max(len(labels), 1)
    bar_w = group_w * 0.8 / max(len(names), 1)
    y_max = y_max if y_max > 0 else 1.0

    def y(v: float) -> float:
        return top + plot_h * (1.0 - min(max(v, 0.0), y_max) / y_max)

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
        f'aria-label="{escape(title)}" font-family="sans-serif" font-size="11">',
        f'<text x="{width / 2:.1f}" y="16" text-anchor="middle" font-size="13">{escape(title)}</text>',
    ]
    for i in range(5):
        v = y_max * i / 4
        parts.append(
            f'<line x1="{left}" x2="{width - right}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#ddd"/>'
            f'<text x="{left - 4}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.2g}</text>'
        )
    if y_label:
        parts.append(
            f'<text transform="translate(12 {top + plot_h / 2:.1f}) rotate(-90)" text-anchor="middle">'
            f"{escape(y_label)}</text>"
        )
    for gi, label in enumerate(labels):
        gx = left + gi * group_w + group_w * 0.1
        for si, name in enumerate(names):
            v = series[name][gi]
            x = gx + si * bar_w
            tip = f"{label} {name}: " + ("n/a" if v is None else f"{v:.3f}")
            if v is None:
                parts.append(
                    f'<text x="{x + bar_w / 2:.1f}" y="{y(0) - 3:.1f}" text-anchor="middle">n/a</text>'
                )
                continue
            parts.append(
                f'<rect x="{x:.1f}" y="{y(v):.1f}" width="{max(bar_w - 1, 1):.1f}" '
                f'height="{y(0) - y(v):.1f}" fill="{PALETTE[si % len(PALETTE)]}"><title>{escape(tip)}</title></rect>'
            )
        short = label if len(label) <= 18 else label[:17] + "…"
        parts.append(
            f'<text x="{left + (gi + 0.5) * group_w:.1f}" y="{top + plot_h + 14}" text-anchor="middle">'
            f"{escape(short)}</text>"
        )
    lx = left
    for si, name in enumerate(names):
        parts.append(
            f'<rect x="{lx}" y="{height - 20}" width="10" height="10" fill="{PALETTE[si % len(PALETTE)]}"/>'
            f'<text x="{lx + 14}" y="{height - 11}">{escape(name)}</text>'
        )
        lx += 14 + 7 * len(name) + 16
    parts.append("</svg>")
    return "".join(parts)
