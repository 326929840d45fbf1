"""Human-readable byte sizes: the one parser and formatter used by the CLI and config."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024, "kib": 1024, "kb": 1000,
    "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
    "g": 1024**3, "gib": 1024**3, "gb": 1000**3,
    "t": 1024**4, "tib": 1024**4, "tb": 1000**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Parse ``10KiB``, ``64MiB``, ``20GiB``, ``1.5GB`` or a plain byte count.

    Binary units (KiB, MiB, GiB, TiB, and the bare K/M/G/T) are powers of 1024;
    decimal ones (KB, MB, GB, TB) are powers of 1000. Raises ``ValueError`` with
    the offending text on anything else.
    """
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must not be negative: {text}")
        return text
    match = _SIZE.match(text)
    unit = match and match.group(2).lower()
    if not match or unit not in _UNITS:
        raise ValueError(f"invalid size {text!r} (expected e.g. 10KiB, 64MiB, 20GiB)")
    return int(float(match.group(1)) * _UNITS[unit])


def format_size(n: float) -> str:
    """Format a byte count with binary units: ``format_size(10240) == '10KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f}{unit}" if unit == "B" or float(n).is_integer() else f"{n:.1f}{unit}"
        n /= 1024
    raise AssertionError("unreachable")


parse_size.__name__ = "size"  # argparse names the type in its errors: "invalid size value: 'abc'"
