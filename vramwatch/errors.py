"""The exception the package raises on purpose, apart from every module that raises it."""

from __future__ import annotations

__all__ = ["ConfigError", "shown"]


class ConfigError(ValueError):
    """A setting is unknown or invalid; raised by ``start()`` before the job runs."""


def shown(value: object) -> str:
    """``repr(value)`` as an error message quotes it: one bad value cannot make a page-long line."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
