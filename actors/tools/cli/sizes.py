"""Parse human sizes such as ``64M`` or ``1G`` (binary units) for the command line."""

from __future__ import annotations

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    s = text.strip().upper().removesuffix("IB").removesuffix("B") or "0"
    num, unit = (s[:-1], s[-1]) if s[-1] in _UNITS else (s, "")
    try:
        value = float(num) * _UNITS[unit]
    except ValueError:
        raise ValueError(f"bad size {text!r}: use a number with an optional K/M/G suffix") from None
    if value <= 0 or value != int(value):
        raise ValueError(f"bad size {text!r}: must be a positive whole number of bytes")
    return int(value)


def parse_sizes(text: str) -> list[int]:
    return [parse_size(part) for part in text.split(",") if part.strip()]


def format_size(n: int) -> str:
    for unit in ("G", "M", "K"):
        if n >= _UNITS[unit] and n % _UNITS[unit] == 0:
            return f"{n // _UNITS[unit]} {unit}iB"
    return f"{n} B"
