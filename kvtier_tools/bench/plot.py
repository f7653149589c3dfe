"""Plots as plain SVG (no plotting library on the GPU machine): points per series on
linear axes, with ticks and a legend; several panels may share one x axis, with
shaded spans across all of them (faults in a timeline)."""

from __future__ import annotations

from html import escape

COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")
W, PANEL_H, LEFT, RIGHT, TOP, BOTTOM, GAP = 760, 330, 70, 170, 40, 50, 30

Series = dict[str, list[tuple[float, float]]]


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    span = (hi - lo) or 1.0
    raw = span / n
    step = min(
        (m * 10**e for e in range(-3, 7) for m in (1, 2, 5) if m * 10**e >= raw), default=raw
    )
    first = -(-lo // step) * step
    return [first + k * step for k in range(int((hi - first) // step) + 1)]


def scatter(series: Series, title: str, xlabel: str, ylabel: str) -> str:
    """An SVG document: each series' (x, y) points as dots, its own colour."""
    return panels([(ylabel, series)], title, xlabel)


def _panel(
    out: list[str], series: Series, ylabel: str, top: float, ph: float, sx, legend: int
) -> int:
    """One panel's frame, y ticks and points into `out`; its series' legend entries from
    number `legend` on; returns the next legend number."""
    pw = W - LEFT - RIGHT
    ys = [y for s in series.values() for _, y in s]
    y1 = (max(ys) * 1.05 if ys else 0.0) or 1.0

    def sy(y: float) -> float:
        return top + ph - y / y1 * ph

    out.append(f'<rect x="{LEFT}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#444"/>')
    for t in _ticks(0.0, y1):
        out.append(
            f'<line x1="{LEFT}" y1="{sy(t):.1f}" x2="{LEFT + pw}" y2="{sy(t):.1f}" stroke="#ddd"/>'
            f'<text x="{LEFT - 6}" y="{sy(t) + 4:.1f}" text-anchor="end">{t:g}</text>'
        )
    out.append(
        f'<text x="16" y="{top + ph / 2}" text-anchor="middle" '
        f'transform="rotate(-90 16 {top + ph / 2})">{escape(ylabel)}</text>'
    )
    for name, points in series.items():
        color = COLORS[legend % len(COLORS)]
        out += [
            f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{color}" fill-opacity="0.75"/>'
            for x, y in points
        ]
        ly = TOP + 16 + 18 * legend
        out.append(
            f'<circle cx="{W - RIGHT + 16}" cy="{ly - 4}" r="4" fill="{color}"/>'
            f'<text x="{W - RIGHT + 26}" y="{ly}">{escape(name)}</text>'
        )
        legend += 1
    return legend


def panels(
    stack: list[tuple[str, Series]],
    title: str,
    xlabel: str,
    spans: list[tuple[float, float, str]] = (),
) -> str:
    """An SVG document of panels stacked over one x axis, each (y label, series); each
    span (x0, x1, label) shaded across every panel and labelled above the first."""
    pts = [p for _, series in stack for s in series.values() for p in s] or [(0.0, 0.0)]
    xs = [x for x, _ in pts] + [x for s in spans for x in s[:2]]
    x0, x1 = min(0.0, min(xs)), max(xs) or 1.0
    ph = PANEL_H - TOP - BOTTOM
    height = TOP + len(stack) * (ph + GAP) + BOTTOM
    pw = W - LEFT - RIGHT

    def sx(x: float) -> float:
        return LEFT + (x - x0) / ((x1 - x0) or 1.0) * pw

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height}" '
        f'font-family="sans-serif" font-size="12">'
        f'<rect width="{W}" height="{height}" fill="white"/>',
        f'<text x="{W / 2}" y="22" text-anchor="middle" font-size="15">{escape(title)}</text>',
    ]
    bottom = TOP + len(stack) * (ph + GAP) - GAP
    for a, b, label in spans:
        out.append(
            f'<rect x="{sx(a):.1f}" y="{TOP}" width="{max(1.0, sx(b) - sx(a)):.1f}" '
            f'height="{bottom - TOP}" '
            f'fill="#d62728" fill-opacity="0.08"/><text x="{sx(a) + 2:.1f}" y="{TOP - 4}" '
            f'font-size="9" '
            f'transform="rotate(-20 {sx(a) + 2:.1f} {TOP - 4})">{escape(label)}</text>'
        )
    legend = 0
    for i, (ylabel, series) in enumerate(stack):
        legend = _panel(out, series, ylabel, TOP + i * (ph + GAP), ph, sx, legend)
    for t in _ticks(x0, x1):
        out.append(
            f'<line x1="{sx(t):.1f}" y1="{bottom}" x2="{sx(t):.1f}" y2="{bottom + 5}" '
            f'stroke="#444"/>'
            f'<text x="{sx(t):.1f}" y="{bottom + 18}" text-anchor="middle">{t:g}</text>'
        )
    out.append(
        f'<text x="{LEFT + pw / 2}" y="{height - 10}" text-anchor="middle">{escape(xlabel)}</text>'
    )
    out.append("</svg>")
    return "\n".join(out)


def _note(text: str, top: float) -> tuple[list[str], float]:
    """A figure's small print (the command that made it), wrapped, from `top` down; the
    elements and the height they take."""
    import textwrap

    lines = textwrap.wrap(text, 125, break_on_hyphens=False) if text else []
    out = [
        f'<text x="10" y="{top + 13 * (i + 1):.0f}" font-size="10" fill="#444">'
        f"{escape(line)}</text>"
        for i, line in enumerate(lines)
    ]
    return out, 13 * len(lines) + (6 if lines else 0)


def _bar(x: float, y: float, width: float, bottom: float, color: str, label: str) -> str:
    """One bar and its value above it, turned upright where the bar is narrower than it."""
    rect = (
        f'<rect x="{x:.1f}" y="{y:.1f}" width="{width * 0.9:.1f}" '
        f'height="{bottom - y:.1f}" fill="{color}"/>'
    )
    cx = x + width * 0.45
    if width * 0.9 >= 7 * len(label):
        return rect + f'<text x="{cx:.1f}" y="{y - 4:.1f}" text-anchor="middle">{label}</text>'
    return rect + (
        f'<text x="{cx + 3:.1f}" y="{y - 4:.1f}" font-size="10" '
        f'transform="rotate(-90 {cx + 3:.1f} {y - 4:.1f})">{label}</text>'
    )


def bars(
    groups: list[str],
    series: dict[str, list[float]],
    title: str,
    ylabel: str,
    fmt: str = ".1f",
    note: str = "",
) -> str:
    """An SVG document: for each group (an x category) one bar per series, labelled with its
    value (`fmt`); series[name][i] is that series' value in groups[i]. `note`, small print
    under the plot: the command that made it."""
    pw, ph = W - LEFT - RIGHT, PANEL_H
    top = TOP
    y1 = max((v for vs in series.values() for v in vs), default=1.0) * 1.15 or 1.0
    slot = pw / max(1, len(groups))
    width = slot * 0.8 / max(1, len(series))
    small, extra = _note(note, top + ph + BOTTOM - 14)
    height = top + ph + BOTTOM + extra

    def sy(y: float) -> float:
        return top + ph - y / y1 * ph

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height}" '
        'font-family="sans-serif" font-size="12">',
        f'<rect width="{W}" height="{height}" fill="white"/>',
        f'<text x="{W / 2}" y="22" text-anchor="middle" font-size="14">{escape(title)}</text>',
        f'<rect x="{LEFT}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#444"/>',
        f'<text x="16" y="{top + ph / 2}" text-anchor="middle" '
        f'transform="rotate(-90 16 {top + ph / 2})">{escape(ylabel)}</text>',
    ]
    for t in _ticks(0.0, y1):
        out.append(
            f'<line x1="{LEFT}" y1="{sy(t):.1f}" x2="{LEFT + pw}" y2="{sy(t):.1f}" stroke="#ddd"/>'
            f'<text x="{LEFT - 6}" y="{sy(t) + 4:.1f}" text-anchor="end">{t:g}</text>'
        )
    for g, group in enumerate(groups):
        x0 = LEFT + g * slot + slot * 0.1
        out.append(
            f'<text x="{LEFT + (g + 0.5) * slot:.1f}" y="{top + ph + 20}" '
            f'text-anchor="middle">{escape(group)}</text>'
        )
        for k, values in enumerate(series.values()):
            color = COLORS[k % len(COLORS)]
            out.append(
                _bar(x0 + k * width, sy(values[g]), width, top + ph, color, f"{values[g]:{fmt}}")
            )
    for k, name in enumerate(series):
        ly = TOP + 16 + 18 * k
        out.append(
            f'<rect x="{W - RIGHT + 12}" y="{ly - 9}" width="9" height="9" '
            f'fill="{COLORS[k % len(COLORS)]}"/>'
            f'<text x="{W - RIGHT + 26}" y="{ly}">{escape(name)}</text>'
        )
    out += small
    out.append("</svg>")
    return "\n".join(out)
