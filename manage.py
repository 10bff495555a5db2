#!/usr/bin/env python
"""Django's command-line utility for Suanli."""

import os
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    from django.conf import settings
    from django.core.management import execute_from_command_line

    from portal import embedded

    settings.INSTALLED_APPS  # noqa: B018  (read the settings first: a bad one stops before anything starts)
    try:
        embedded.ensure_wanted()
    except embedded.EmbeddedServiceError as exc:
        sys.stderr.write(f"suanli: {exc}\n")
        raise SystemExit(1) from None
    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
