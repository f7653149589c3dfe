"""Plots as plain SVG (no plotting library on the GPU machine): points per series on
linear axes, with ticks and a legend."""

from __future__ import annotations

from html import escape

COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")
W, H, LEFT, RIGHT, TOP, BOTTOM = 760, 420, 70, 170, 40, 50


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    span = (hi - lo) or 1.0
    raw = span / n
    step = min((m * 10 ** e for e in range(-3, 7) for m in (1, 2, 5) if m * 10 ** e >= raw), default=raw)
    first = -(-lo // step) * step
    return [first + k * step for k in range(int((hi - first) // step) + 1)]


def scatter(series: dict[str, list[tuple[float, float]]], title: str, xlabel: str, ylabel: str) -> str:
    """An SVG document: each series' (x, y) points as dots, its own colour."""
    pts = [p for s in series.values() for p in s] or [(0.0, 0.0)]
    x0, x1 = min(0.0, min(x for x, _ in pts)), max(x for x, _ in pts) or 1.0
    y0, y1 = 0.0, max(y for _, y in pts) * 1.05 or 1.0
    pw, ph = W - LEFT - RIGHT, H - TOP - BOTTOM

    def sx(x: float) -> float:
        return LEFT + (x - x0) / ((x1 - x0) or 1.0) * pw

    def sy(y: float) -> float:
        return TOP + ph - (y - y0) / ((y1 - y0) or 1.0) * ph

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" '
           f'font-size="12"><rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{W / 2}" y="22" text-anchor="middle" font-size="15">{escape(title)}</text>',
           f'<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="none" stroke="#444"/>']
    for t in _ticks(x0, x1):
        out.append(f'<line x1="{sx(t):.1f}" y1="{TOP + ph}" x2="{sx(t):.1f}" y2="{TOP + ph + 5}" stroke="#444"/>'
                   f'<text x="{sx(t):.1f}" y="{TOP + ph + 18}" text-anchor="middle">{t:g}</text>')
    for t in _ticks(y0, y1):
        out.append(f'<line x1="{LEFT}" y1="{sy(t):.1f}" x2="{LEFT + pw}" y2="{sy(t):.1f}" stroke="#ddd"/>'
                   f'<text x="{LEFT - 6}" y="{sy(t) + 4:.1f}" text-anchor="end">{t:g}</text>')
    out.append(f'<text x="{LEFT + pw / 2}" y="{H - 10}" text-anchor="middle">{escape(xlabel)}</text>'
               f'<text x="16" y="{TOP + ph / 2}" text-anchor="middle" '
               f'transform="rotate(-90 16 {TOP + ph / 2})">{escape(ylabel)}</text>')
    for k, (name, points) in enumerate(series.items()):
        color = COLORS[k % len(COLORS)]
        out += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{color}" fill-opacity="0.75"/>'
                for x, y in points]
        ly = TOP + 16 + 18 * k
        out.append(f'<circle cx="{W - RIGHT + 16}" cy="{ly - 4}" r="4" fill="{color}"/>'
                   f'<text x="{W - RIGHT + 26}" y="{ly}">{escape(name)}</text>')
    out.append("</svg>")
    return "\n".join(out)
