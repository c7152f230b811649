"""Byte sizes: parsed and printed the way vLLM's flags and logs write them.

vLLM-free, like the rest of ``core``, so ``kvmem plan`` parses and prints
sizes where vLLM is not installed.
"""

from __future__ import annotations

import re

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40

_UNITS = {"TiB": TiB, "GiB": GiB, "MiB": MiB, "KiB": KiB}
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": KiB, "M": MiB, "G": GiB, "T": TiB}


def cdiv(a: int, b: int) -> int:
    """Ceiling division, like ``vllm.utils.math_utils.cdiv``."""
    return -(a // -b)


def parse_size(value: str | int, *, flag: str = "size") -> int:
    """Parse a size the way vLLM's ``human_readable_int`` does.

    ``k/m/g/t`` are decimal and take decimals (``1.5g`` = 1,500,000,000);
    ``K/M/G/T`` are binary and refuse decimals (``5G`` = 5 * 2**30); anything
    else must be a plain integer. The one size parser of vllm-kvmem, written
    out rather than imported so that it works without vLLM; a test holds it to
    ``human_readable_int`` on accepted and refused inputs alike.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    text = str(value).strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", text)
    if match:
        number, suffix = match.groups()
        if suffix in _DECIMAL:
            return int(float(number) * _DECIMAL[suffix])
        if "." in number:
            raise ValueError(
                f"{flag}={text!r}: decimals are not allowed with binary suffixes "
                f"like {suffix}; use {number}{suffix.lower()} (decimal) or a whole "
                f"number of {suffix}iB, e.g. {int(float(number) * 1024)}"
                f"{_smaller(suffix)}"
            )
        return int(number) * _BINARY[suffix]
    try:
        return int(text)
    except ValueError:
        if "token" in flag:
            raise ValueError(
                f"{flag}={text!r} is not a token count; use a number (400000), "
                "decimal units (400k, 1.5m) or binary units (512K)"
            ) from None
        raise ValueError(
            f"{flag}={text!r} is not a size; use bytes (400000), binary units "
            "(512M, 5G, 1T) or decimal units (1.5g, 400k)"
        ) from None


def _smaller(suffix: str) -> str:
    return {"K": "", "M": "K", "G": "M", "T": "G"}[suffix]


def parse_positive_size(value: str | int, *, flag: str) -> int:
    """A size that must be > 0 (budgets, device memory)."""
    n = parse_size(value, flag=flag)
    if n <= 0:
        example = "400k or 400000" if "token" in flag else "5G or 400000"
        raise ValueError(f"{flag}={value!r}: must be positive, e.g. {example}")
    return n


def format_bytes(
    num_bytes: int | float,
    unit: str | None = None,
    *,
    digits: int = 2,
    grouped: bool = False,
    label: bool = True,
) -> str:
    """The one byte formatter: ``num_bytes`` in ``unit`` (KiB, MiB, GiB, TiB).

    ``unit=None`` picks the largest unit not above the size (bytes below 1
    KiB), for messages operators read; ``grouped`` puts thousands separators
    in; ``label=False`` leaves the unit out, for table columns and vLLM-style
    ``%s GiB`` log arguments.
    """
    if unit is None:
        unit = next((u for u, s in _UNITS.items() if abs(num_bytes) >= s), None)
        if unit is None:
            return f"{int(num_bytes)} B"
    value = f"{num_bytes / _UNITS[unit]:{',' if grouped else ''}.{digits}f}"
    return f"{value} {unit}" if label else value


def gib(num_bytes: int | float, digits: int = 2) -> str:
    """GiB without the unit, like vLLM's ``format_gib`` (logs say ``%s GiB``)."""
    return format_bytes(num_bytes, "GiB", digits=digits, label=False)


def mib(num_bytes: int | float) -> str:
    """``1,234.56 MiB``: fine enough for error messages to tell close sizes apart."""
    return format_bytes(num_bytes, "MiB", grouped=True)


def flag_size(num_bytes: int, *, round_up: bool = True) -> str:
    """A value ``--kv-cache-memory-bytes`` accepts, rounded to a whole MiB.

    Up (at least ``num_bytes``: a minimum to suggest) or down (at most: a
    maximum). vLLM's size parser takes ``K``/``M``/``G`` as binary
    multipliers but refuses decimals with them.
    """
    mib = cdiv(num_bytes, MiB) if round_up else num_bytes // MiB
    if mib % 1024 == 0:
        return f"{mib // 1024}G"
    return f"{mib}M"
