"""SVG charts for the HTML report: stacked bars over time, a line over time, ranked bars.

Drawn here rather than by a charting library: the page must open from disk with no script and
no network, and the charts need what pygal (used before) did not give without fighting it:
axis ticks on round steps labelled with as many decimals as the step needs (a $0.0025 step
reads $0.0025, $0.0050, ...; pygal's formatter repeated "$0.03"), one fixed colour per model
across charts, the biggest spender first with its value printed, and native hover tooltips
(SVG ``<title>``) without JavaScript. About 200 lines of plain SVG, against a dependency that
patches ``sys.meta_path`` on import.

Geometry is in float pixels (display only); every label is formatted from the exact value.
All text is escaped: model names and keys come from clients.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal
from html import escape

__all__ = [
    "OTHER",
    "OTHER_COLOUR",
    "PALETTE",
    "Series",
    "colours",
    "line",
    "nice_ticks",
    "percent_axis",
    "ranked_bars",
    "stacked_bars",
    "usd_axis",
]

PALETTE = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f")
"""Tableau 10's categorical colours (its grey kept for ``other``): distinct from one another, on white."""
OTHER = "(other)"
"""The name of the series that gathers everything past the named ones."""
OTHER_COLOUR = "#bab0ac"
"""The colour of :data:`OTHER`."""

_CHAR = 7.0  # px per character of 12 px text, for margins (digits and lowercase run narrower)
_STEPS = (Decimal(1), Decimal(2), Decimal("2.5"), Decimal(5), Decimal(10))


@dataclass(frozen=True, slots=True)
class Series:
    """One named series: a value per bucket (``None``: nothing there), drawn in ``colour``."""

    name: str
    colour: str
    values: Sequence[Decimal | None]


def colours(names: Sequence[str]) -> dict[str, str]:
    """A colour for each name, in the order given (biggest first); :data:`OTHER` is grey.

    Names past the palette's nine share that grey too: callers keep at most nine named.
    """
    named = [n for n in names if n != OTHER]
    result = {n: PALETTE[i] if i < len(PALETTE) else OTHER_COLOUR for i, n in enumerate(named)}
    if OTHER in names:
        result[OTHER] = OTHER_COLOUR
    return result


def nice_ticks(top: Decimal, count: int = 5) -> list[Decimal]:
    """Ticks from 0 to at least ``top`` on a round step (1, 2, 2.5 or 5 x a power of ten).

    About ``count`` steps; every tick is an exact multiple of the step, so labels with the
    step's decimals are all distinct. ``top`` <= 0 gives ``[0, 1]``.
    """
    if top <= 0:
        return [Decimal(0), Decimal(1)]
    raw = top / count
    exponent = raw.adjusted()
    fraction = raw.scaleb(-exponent)
    step = next(s for s in _STEPS if s >= fraction).scaleb(exponent)
    steps = int(math.ceil(top / step))
    return [step * i for i in range(steps + 1)]


def _places(ticks: Sequence[Decimal]) -> int:
    """Decimals that show every tick exactly (those of the step)."""
    return max((max(0, -t.normalize().as_tuple().exponent) for t in ticks), default=0)  # type: ignore[operator]


def usd_axis(top: Decimal) -> tuple[list[Decimal], list[str]]:
    """Ticks for a USD axis reaching ``top``, and their labels (``$0.0025``, ``$0.50``, ``$1,000``).

    Labels carry the step's decimals, and cents at least when the step is under a dollar.
    """
    ticks = nice_ticks(top)
    places = _places(ticks)
    places = max(places, 2) if places else 0
    return ticks, [f"${t:,.{places}f}" for t in ticks]


def percent_axis() -> tuple[list[Decimal], list[str]]:
    """Ticks 0 to 100 % in steps of 20."""
    ticks = [Decimal(p) for p in range(0, 101, 20)]
    return ticks, [f"{t}%" for t in ticks]


def _svg(width: int, height: int, label: str, body: list[str]) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" width="100%" '
        f'style="max-width:{width}px" role="img" aria-label="{escape(label)}">' + "".join(body) + "</svg>"
    )


@dataclass(frozen=True, slots=True)
class _Frame:
    """A time chart's plot area, its y scale and the slot of each bucket."""

    width: int
    height: int
    left: float
    top: float
    bottom: float
    ymax: float
    buckets: int

    @property
    def slot(self) -> float:
        return (self.width - self.left - 12) / max(self.buckets, 1)

    def x(self, i: int) -> float:
        return self.left + self.slot * i

    def y(self, value: float) -> float:
        return self.bottom - (self.bottom - self.top) * min(value, self.ymax) / self.ymax


def _axes(frame: _Frame, ticks: Sequence[Decimal], tick_labels: Sequence[str], x_labels: Sequence[str]) -> list[str]:
    out = ['<g class="grid">']
    for tick in ticks:
        y = frame.y(float(tick))
        out.append(f'<line x1="{frame.left:.1f}" x2="{frame.width - 12}" y1="{y:.1f}" y2="{y:.1f}"/>')
    out.append('</g><g class="y-axis">')
    for tick, text in zip(ticks, tick_labels, strict=True):
        out.append(f'<text x="{frame.left - 6:.1f}" y="{frame.y(float(tick)) + 4:.1f}">{escape(text)}</text>')
    out.append('</g><g class="x-axis">')
    longest = max((len(t) for t in x_labels), default=1)
    every = max(1, math.ceil((longest * _CHAR + 14) / frame.slot))
    for i in range(0, len(x_labels), every):
        x = frame.x(i) + frame.slot / 2
        out.append(f'<text x="{x:.1f}" y="{frame.bottom + 18:.1f}">{escape(x_labels[i])}</text>')
    out.append("</g>")
    return out


def _frame(width: int, height: int, tick_labels: Sequence[str], buckets: int, ymax: Decimal) -> _Frame:
    left = 14 + _CHAR * max(len(t) for t in tick_labels)
    return _Frame(width, height, left, 10, height - 28, float(ymax) or 1.0, buckets)


def stacked_bars(
    title: str,
    x_labels: Sequence[str],
    series: Sequence[Series],
    tip: Callable[[int, str, Decimal], str],
    *,
    width: int = 960,
    height: int = 300,
) -> str:
    """Bars per bucket, ``series`` stacked in order from the bottom, on a USD axis.

    ``x_labels``: one per bucket (thinned out when they would overlap); ``tip(bucket, series
    name, value)``: the hover text of a segment.
    """
    totals = [sum((s.values[i] or Decimal(0) for s in series), Decimal(0)) for i in range(len(x_labels))]
    ticks, labels = usd_axis(max(totals, default=Decimal(0)))
    frame = _frame(width, height, labels, len(x_labels), ticks[-1])
    body = _axes(frame, ticks, labels, x_labels)
    bar = max(frame.slot * 0.78, 1.0)
    body.append('<g class="bars">')
    for i in range(len(x_labels)):
        base = 0.0
        for s in series:
            value = s.values[i]
            if not value:
                continue
            y0, y1 = frame.y(base), frame.y(base + float(value))
            base += float(value)
            body.append(
                f'<rect x="{frame.x(i) + (frame.slot - bar) / 2:.1f}" y="{y1:.1f}" width="{bar:.1f}" '
                f'height="{max(y0 - y1, 0.5):.1f}" fill="{s.colour}">'
                f"<title>{escape(tip(i, s.name, value))}</title></rect>"
            )
    body.append("</g>")
    return _svg(width, height, title, body)


def line(
    title: str,
    x_labels: Sequence[str],
    values: Sequence[Decimal | None],
    tip: Callable[[int, Decimal], str],
    *,
    colour: str = PALETTE[0],
    width: int = 470,
    height: int = 240,
) -> str:
    """A percentage (0 to 100) per bucket as a line with points; ``None`` leaves a gap."""
    ticks, labels = percent_axis()
    frame = _frame(width, height, labels, len(x_labels), ticks[-1])
    body = _axes(frame, ticks, labels, x_labels)
    runs: list[list[str]] = [[]]
    dots = []
    for i, value in enumerate(values):
        if value is None:
            runs.append([])
            continue
        x, y = frame.x(i) + frame.slot / 2, frame.y(float(value))
        runs[-1].append(f"{x:.1f},{y:.1f}")
        dots.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3"><title>{escape(tip(i, value))}</title></circle>')
    body.append(f'<g class="line" stroke="{colour}" fill="{colour}">')
    body += [f'<polyline fill="none" points="{" ".join(r)}"/>' for r in runs if len(r) > 1]
    body += dots
    body.append("</g>")
    return _svg(width, height, title, body)


def ranked_bars(title: str, rows: Sequence[tuple[str, Decimal, str, str]], *, width: int = 470) -> str:
    """Horizontal bars, one per ``(name, value, colour, value text)`` row, top to bottom as given.

    Put the biggest first. Each bar carries its value text at its end; names longer than 26
    characters are shortened (the full name is the tooltip).
    """
    names = [n if len(n) <= 26 else n[:25] + "…" for n, _, _, _ in rows]
    left = 10 + _CHAR * max((len(n) for n in names), default=4)
    right = 10 + _CHAR * max((len(t) for _, _, _, t in rows), default=4)
    row_height, top = 24, 6
    height = top * 2 + row_height * max(len(rows), 1)
    biggest = max((float(v) for _, v, _, _ in rows), default=0.0) or 1.0
    span = width - left - right
    body = ['<g class="ranked">']
    for i, ((name, value, colour, text), short) in enumerate(zip(rows, names, strict=True)):
        y = top + row_height * i
        length = max(span * max(float(value), 0.0) / biggest, 1.0)
        body.append(
            f"<g><title>{escape(name)}: {escape(text)}</title>"
            f'<text class="name" x="{left - 6:.1f}" y="{y + 16}">{escape(short)}</text>'
            f'<rect x="{left:.1f}" y="{y + 4}" width="{length:.1f}" height="{row_height - 8}" fill="{colour}"/>'
            f'<text class="value" x="{left + length + 5:.1f}" y="{y + 16}">{escape(text)}</text></g>'
        )
    body.append("</g>")
    return _svg(width, height, title, body)
