"""Template filters for amounts, card hours, durations, and charts drawn on the server as SVG."""

from __future__ import annotations

from decimal import ROUND_HALF_EVEN, Decimal

from django import template
from django.conf import settings
from django.utils.html import format_html, format_html_join
from django.utils.translation import gettext as _

from core.units import micros_to_hours, money_text
from provisioner.models import Session

register = template.Library()

MICROS = Decimal(1_000_000)


@register.filter
def money(micros: int | None, places: int = 2) -> str:
    """``12345678`` micros → ``¥12.35`` in the site currency."""
    if micros is None:
        return "—"
    return money_text(int(micros), currency=settings.SITE_CURRENCY, places=int(places))


@register.filter
def state_label(state: str) -> str:
    """A session state's name in the user's language (``running`` → 运行中)."""
    try:
        return str(Session.State(state).label)
    except ValueError:
        return state


@register.filter
def amount(micros: int | None) -> str:
    """``12345678`` micros → ``12.35``: an amount for a form field, without the currency symbol."""
    if micros is None:
        return ""
    return f"{(Decimal(int(micros)) / MICROS).quantize(Decimal('0.01'), rounding=ROUND_HALF_EVEN)}"


@register.filter
def hours_value(micros: int | None) -> str:
    """Card-hour micros → ``12.5``: hours for a form field, without the unit."""
    if micros is None:
        return ""
    return f"{micros_to_hours(int(micros)).normalize():f}"


@register.filter
def card_hours(micros: int | None) -> str:
    """Card-hour micros → ``12.5 h`` (card hours of the reference GPU)."""
    if micros is None:
        return "—"
    hours = micros_to_hours(int(micros)).quantize(Decimal("0.01"), rounding=ROUND_HALF_EVEN).normalize()
    return _("%(hours)s h") % {"hours": f"{hours:f}"}


@register.filter
def duration(seconds: int | float | None) -> str:
    if seconds is None:
        return "—"
    seconds = int(seconds)
    if seconds < 60:
        return _("%(n)d s") % {"n": seconds}
    minutes = seconds // 60
    if minutes < 60:
        return _("%(n)d min") % {"n": minutes}
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return _("%(h)d h %(m)d min") % {"h": hours, "m": minutes}
    return _("%(d)d days") % {"d": hours // 24}


def _chart(width: int, height: int, label: str, body: str) -> str:
    """An SVG chart drawn by the server: scales to its box, labelled for screen readers."""
    return format_html(
        '<svg class="chart" viewBox="0 0 {} {}" role="img" aria-label="{}" preserveAspectRatio="none">'
        "{}</svg>",
        width,
        height,
        label,
        body,
    )


@register.simple_tag
def bar_chart(points: list[tuple[str, int]], height: int = 120, label: str = "") -> str:
    """A bar per (label, value); values are non-negative integers (micros, counts)."""
    width = max(len(points), 1) * 12
    top = max((value for _, value in points), default=0) or 1
    bars = []
    for index, (name, value) in enumerate(points):
        bar_height = round(value / top * (height - 14))
        bars.append((index * 12 + 1, height - bar_height, max(bar_height, 0), f"{name}: {money(value)}"))
    return _chart(
        width, height, label, format_html_join("", '<rect x="{}" y="{}" width="10" height="{}" rx="2">'
        "<title>{}</title></rect>", bars)
    )  # fmt: skip


@register.simple_tag
def line_chart(
    series: dict[str, list[float | None]], height: int = 120, maximum: float = 100, label: str = ""
) -> str:
    """Lines over equally spaced samples (e.g. GPU utilisation % and memory %), gaps where None."""
    length = max((len(values) for values in series.values()), default=0)
    width = max(length - 1, 1) * 8
    paths = []
    for index, (name, values) in enumerate(series.items()):
        segments, current = [], []
        for x, value in enumerate(values):
            if value is None:
                if current:
                    segments.append(current)
                current = []
                continue
            y = height - 4 - (min(float(value), maximum) / maximum) * (height - 8)
            current.append(f"{x * 8},{y:.1f}")
        if current:
            segments.append(current)
        for segment in segments:
            paths.append((f"series-{index}", " ".join(segment), name))
    return _chart(
        width, height, label, format_html_join("", '<polyline class="{}" points="{}" fill="none">'
        "<title>{}</title></polyline>", paths)
    )  # fmt: skip


@register.simple_tag
def slot_map(cells: list[str]) -> str:
    """Eight cells of a GPU: 'free' or a short owner label."""
    return format_html(
        '<span class="slotmap">{}</span>',
        format_html_join(
            "",
            '<span class="slot {}" title="{}"></span>',
            (("free" if cell == "free" else "taken", cell) for cell in cells),
        ),
    )
