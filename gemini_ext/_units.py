"""Byte sizes written as ints or strings ("512MiB", "16GiB", "1.5GB")."""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}


def parse_bytes(value, field: str) -> int:
    """Returns `value` in bytes; raises ValueError naming `field` when it is not a size."""
    if isinstance(value, bool):
        raise ValueError(f"{field}: expected a byte count (int) or a string such as '16GiB', got {value!r}.")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"{field}: expected a positive number of bytes, got {value}.")
        return value
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if match and match.group(2).lower() in _UNITS:
            number = float(match.group(1)) * _UNITS[match.group(2).lower()]
            if number >= 1:
                return int(number)
    raise ValueError(f"{field}: expected a byte count (int) or a string such as '512MiB' or '16GiB', "
                     f"got {value!r}. Units: B, KiB, MiB, GiB, TiB, KB, MB, GB, TB.")


def format_bytes(n: int | float) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"
