"""Durations as people type them on a command line: ``90s``, ``30m``, ``2h``, ``1d``."""

import re
from datetime import timedelta

UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}


def parse_duration(text: str) -> timedelta | None:
    """``text`` as a duration, or None when it is not one."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", text.strip())
    return timedelta(**{UNITS[match[2]]: float(match[1])}) if match else None
