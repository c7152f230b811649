"""vLLM's code style for the files the series adds (stub: text unchanged)."""

from __future__ import annotations


def format_python(path: str, text: str) -> str:
    """``text`` of the new file ``path`` as vLLM's style wants it."""
    return text
