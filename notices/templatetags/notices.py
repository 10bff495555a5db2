from __future__ import annotations

from django import template
from django.template.loader import render_to_string

register = template.Library()


@register.simple_tag
def notice_line(notice) -> str:
    """One notice's line (``notices/item.html``), rendered once a page: the bell and the dashboard's
    list show the same notices, the same objects, read once a request (``notices.context_processors``).
    The line depends on nothing of the page around it; its buttons post through the list's form."""
    line = notice.__dict__.get("_line_html")
    if line is None:
        line = notice.__dict__["_line_html"] = render_to_string("notices/item.html", {"notice": notice})
    return line
