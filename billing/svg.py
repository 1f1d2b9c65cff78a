"""Inline SVG charts for the HTML dashboard: bars (grouped or stacked), lines, h-bars.

Pure functions from numbers to markup, no script and nothing fetched: the dashboard
must render on machines without internet access, and in a headless browser.
Every text that came from data is escaped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from html import escape

PALETTE = ("#2563eb", "#f97316", "#16a34a", "#dc2626", "#9333ea", "#0891b2", "#ca8a04", "#db2777")
Format = Callable[[float], str]

_LEFT, _RIGHT, _TOP, _BOTTOM = 64, 16, 12, 44


@dataclass(frozen=True)
class Series:
    name: str
    values: Sequence[float]


def compact(value: float) -> str:
    """1234 -> '1.23k', 0.000123 -> '0.000123': short tick labels."""
    magnitude = abs(value)
    if magnitude >= 1e9:
        return f"{value / 1e9:.3g}G"
    if magnitude >= 1e6:
        return f"{value / 1e6:.3g}M"
    if magnitude >= 1e3:
        return f"{value / 1e3:.3g}k"
    if 0 < magnitude < 0.01:
        return f"{value:.7f}".rstrip("0")  # 0.00005, not 5e-05
    return f"{value:.3g}"


def nice_ticks(top: float, count: int = 5) -> list[float]:
    """0 and round steps up to at least ``top`` (1, 2 or 5 times a power of ten)."""
    if top <= 0 or not math.isfinite(top):
        return [0.0, 1.0]
    raw = top / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    num_steps = math.ceil(top / step - 1e-9)
    return [round(i * step, 12) for i in range(num_steps + 1)]


def bar_chart(
    categories: Sequence[str],
    series: Sequence[Series],
    *,
    stacked: bool = False,
    width: int = 640,
    height: int = 260,
    fmt: Format = compact,
) -> str:
    """One group of bars per category: side by side, or stacked when ``stacked``."""
    if not categories or not series:
        return _empty(width, height)
    totals = [
        sum(s.values[i] for s in series) if stacked else max(s.values[i] for s in series)
        for i in range(len(categories))
    ]
    ticks = nice_ticks(max(totals))
    plot_w, plot_h = width - _LEFT - _RIGHT, height - _TOP - _BOTTOM
    y = _scale(ticks[-1], plot_h)
    slot = plot_w / len(categories)
    bar_w = slot * 0.7 / (1 if stacked else len(series))
    parts = [_y_axis(ticks, y, plot_w, fmt)]
    for i, category in enumerate(categories):
        x0 = _LEFT + i * slot + slot * 0.15
        base = 0.0
        for j, s in enumerate(series):
            value = s.values[i]
            x = x0 if stacked else x0 + j * bar_w
            top = base + value if stacked else value
            parts.append(
                f'<rect x="{x:.1f}" y="{y(top):.1f}" width="{max(bar_w - 1, 1):.1f}" '
                f'height="{max(y(base if stacked else 0) - y(top), 0):.1f}" '
                f'fill="{PALETTE[j % len(PALETTE)]}"><title>{escape(s.name)} '
                f"{escape(category)}: {escape(fmt(value))}</title></rect>"
            )
            if stacked:
                base = top
        parts.append(_x_label(_LEFT + i * slot + slot / 2, height, category, len(categories)))
    return _svg(width, height, parts, [s.name for s in series])


def line_chart(
    labels: Sequence[str],
    series: Sequence[Series],
    *,
    width: int = 640,
    height: int = 260,
    fmt: Format = compact,
) -> str:
    """One line per series over shared x positions (e.g. minutes), with dots."""
    if not labels or not series:
        return _empty(width, height)
    ticks = nice_ticks(max(max(s.values) for s in series))
    plot_w, plot_h = width - _LEFT - _RIGHT, height - _TOP - _BOTTOM
    y = _scale(ticks[-1], plot_h)
    step = plot_w / max(len(labels) - 1, 1)
    parts = [_y_axis(ticks, y, plot_w, fmt)]
    for j, s in enumerate(series):
        colour = PALETTE[j % len(PALETTE)]
        points = [(_LEFT + i * step, y(v)) for i, v in enumerate(s.values)]
        path = " ".join(f"{px:.1f},{py:.1f}" for px, py in points)
        parts.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"/>')
        parts.extend(
            f'<circle cx="{px:.1f}" cy="{py:.1f}" r="2.5" fill="{colour}">'
            f"<title>{escape(s.name)} {escape(labels[i])}: {escape(fmt(s.values[i]))}</title>"
            "</circle>"
            for i, (px, py) in enumerate(points)
        )
    every = max(1, math.ceil(len(labels) / 8))
    for i in range(0, len(labels), every):
        parts.append(_x_label(_LEFT + i * step, height, labels[i], 8))
    return _svg(width, height, parts, [s.name for s in series])


def hbar_chart(
    labels: Sequence[str],
    values: Sequence[float],
    *,
    width: int = 640,
    bar_height: int = 22,
    fmt: Format = compact,
    maximum: float | None = None,
) -> str:
    """One horizontal bar per label, the value written at its end."""
    if not labels:
        return _empty(width, 80)
    label_w, value_w = 200, 90
    plot_w = width - label_w - value_w
    top = maximum if maximum is not None else max(max(values), 0) or 1.0
    height = len(labels) * (bar_height + 6) + 8
    parts = []
    for i, (label, value) in enumerate(zip(labels, values, strict=True)):
        row_y = 4 + i * (bar_height + 6)
        length = plot_w * max(value, 0) / top if top else 0
        parts.append(
            f'<text x="{label_w - 8}" y="{row_y + bar_height * 0.7:.1f}" text-anchor="end" '
            f'class="label">{escape(_clip(label, 28))}</text>'
            f'<rect x="{label_w}" y="{row_y}" width="{max(length, 1):.1f}" '
            f'height="{bar_height}" fill="{PALETTE[0]}"><title>{escape(label)}: '
            f"{escape(fmt(value))}</title></rect>"
            f'<text x="{label_w + length + 6:.1f}" y="{row_y + bar_height * 0.7:.1f}" '
            f'class="value">{escape(fmt(value))}</text>'
        )
    return _svg(width, height, parts, [])


def _scale(top: float, plot_h: float) -> Callable[[float], float]:
    return lambda value: _TOP + plot_h - (plot_h * value / top if top else 0)


def _y_axis(ticks: list[float], y: Callable[[float], float], plot_w: float, fmt: Format) -> str:
    lines = []
    for tick in ticks:
        lines.append(
            f'<line x1="{_LEFT}" x2="{_LEFT + plot_w:.1f}" y1="{y(tick):.1f}" y2="{y(tick):.1f}" '
            f'class="grid"/><text x="{_LEFT - 6}" y="{y(tick) + 4:.1f}" text-anchor="end" '
            f'class="tick">{escape(fmt(tick))}</text>'
        )
    return "".join(lines)


def _x_label(x: float, height: int, text: str, num_labels: int) -> str:
    return (
        f'<text x="{x:.1f}" y="{height - _BOTTOM + 16}" text-anchor="middle" class="tick">'
        f"{escape(_clip(text, 10 if num_labels > 6 else 18))}</text>"
    )


def _svg(width: int, height: int, parts: list[str], legend: list[str]) -> str:
    keys = "".join(
        f'<span class="key"><i style="background:{PALETTE[j % len(PALETTE)]}"></i>'
        f"{escape(name)}</span>"
        for j, name in enumerate(legend)
    )
    return (
        f'<svg viewBox="0 0 {width} {height}" width="100%" role="img" '
        f'xmlns="http://www.w3.org/2000/svg">{"".join(parts)}</svg>'
        + (f'<div class="legend">{keys}</div>' if len(legend) > 1 else "")
    )


def _empty(width: int, height: int) -> str:
    return (
        f'<svg viewBox="0 0 {width} {height}" width="100%" xmlns="http://www.w3.org/2000/svg">'
        f'<text x="{width / 2}" y="{height / 2}" text-anchor="middle" class="tick">'
        "no data in this window</text></svg>"
    )


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"
