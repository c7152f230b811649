"""Byte sizes in the form vLLM's logs and flags use."""

from __future__ import annotations

GiB = 1 << 30
MiB = 1 << 20


def gib(num_bytes: int | float) -> str:
    """Format like vLLM's ``format_gib``: two decimals, no unit."""
    return f"{num_bytes / GiB:.2f}"


def human_bytes(num_bytes: int | float) -> str:
    """A short size with its unit, for error messages operators copy from."""
    value = float(num_bytes)
    for unit, scale in (("T", 1 << 40), ("G", GiB), ("M", MiB), ("K", 1 << 10)):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {unit}iB"
    return f"{int(value)} B"


def flag_size(num_bytes: int) -> str:
    """A value ``--kv-cache-memory-bytes`` accepts that is >= ``num_bytes``.

    vLLM's size parser takes ``K``/``M``/``G`` as binary multipliers but refuses
    decimals with them, so round up to a whole MiB.
    """
    mib = -(-num_bytes // MiB)
    if mib % 1024 == 0:
        return f"{mib // 1024}G"
    return f"{mib}M"
